"""GroupPages: the page-lists-per-layer-group boundary type."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from kvtool.group_pages import GroupPages
from kvtool.types import BAD_PAGE_INDEX as B

page_lists = st.dictionaries(st.integers(0, 3), st.lists(st.integers(-1, 50), max_size=12), max_size=4)


def test_flat_is_the_only_groups_list_or_empty_with_several():
    assert GroupPages({0: [3, 4]}).flat() == [3, 4]
    assert GroupPages({0: [3, 4], 1: [5]}).flat() == []
    assert GroupPages().flat() == []


def test_valid_skips_bad_page_entries_and_keeps_ordinals():
    pages = GroupPages({0: [B, B, 7, 8], 1: [1, 2, 3, 4]})
    assert list(pages.valid(0)) == [(2, 7), (3, 8)]
    assert list(pages.valid(5)) == []


def test_equal_to_a_dict_of_lists_and_immutable():
    pages = GroupPages({1: [4, 5]})
    assert pages == {1: [4, 5]} and pages == {1: (4, 5)} and pages != {1: [4]} and pages != {2: [4, 5]}
    assert pages[1] == (4, 5)
    with pytest.raises(TypeError):
        pages[1] = (9,)              # type: ignore[index]
    with pytest.raises(AttributeError):
        pages[1].append(9)           # type: ignore[attr-defined]


def test_since_reports_only_what_was_appended():
    old = GroupPages({0: [1, 2], 1: [B]})
    new = GroupPages({0: [1, 2, 3], 1: [B, 4, 5], 2: [9]})
    assert new.since(old.lengths()) == {0: [3], 1: [4, 5], 2: [9]}


@given(first=page_lists, growth=page_lists)
def test_since_then_extended_rebuilds_the_lists(first, growth):
    """A receiver that applies every append-delta to what it has ends with the sender's lists."""
    before = GroupPages(first)
    after = GroupPages({g: first.get(g, []) + growth.get(g, []) for g in {**first, **growth}})
    assert before.extended(after.since(before.lengths())) == after
    assert GroupPages().extended(after) == after
