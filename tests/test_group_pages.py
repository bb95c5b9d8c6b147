"""GroupPages: the page-lists-per-layer-group boundary type, shaped as TensorRT-LLM's List[List[int]]."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtool.group_pages import GroupPages
from kvtool.types import BAD_PAGE_INDEX as B

page_lists = st.lists(st.lists(st.integers(-1, 50), max_size=12), max_size=4)


def test_iteration_yields_each_groups_list_and_position_is_the_group_id():
    pages = GroupPages([[3, 4], [B, 5]])
    assert [list(p) for p in pages] == [[3, 4], [B, 5]]
    assert [(g, list(p)) for g, p in enumerate(pages)] == [(0, [3, 4]), (1, [B, 5])]
    assert list(pages.items()) == list(enumerate(pages))
    assert pages[1] == (B, 5) and len(pages) == 2


def test_as_lists_hands_out_fresh_lists_a_connector_may_change():
    pages = GroupPages([[3, 4]])
    lists = pages.as_lists()
    assert lists == [[3, 4]] and type(lists) is list and type(lists[0]) is list
    lists[0].append(9)
    assert pages == [[3, 4]]


def test_flat_is_the_only_groups_list_or_empty_with_several():
    assert GroupPages([[3, 4]]).flat() == [3, 4]
    assert GroupPages([[3, 4], [5]]).flat() == []
    assert GroupPages().flat() == []


def test_valid_skips_bad_page_entries_and_keeps_ordinals():
    pages = GroupPages([[B, B, 7, 8], [1, 2, 3, 4]])
    assert list(pages.valid(0)) == [(2, 7), (3, 8)]
    assert list(pages.valid(5)) == []


def test_equal_to_a_list_of_lists_and_immutable():
    pages = GroupPages([[], [4, 5]])
    assert pages == [[], [4, 5]] and pages == ([], (4, 5)) and pages != [[], [4]] and pages != [[4, 5]]
    assert pages[1] == (4, 5)
    with pytest.raises(TypeError):
        pages[1] = (9,)              # type: ignore[index]
    with pytest.raises(AttributeError):
        pages[1].append(9)           # type: ignore[attr-defined]


def test_since_reports_only_what_was_appended():
    old = GroupPages([[1, 2], [B]])
    new = GroupPages([[1, 2, 3], [B, 4, 5], [9]])
    assert new.since(old.lengths()) == [[3], [4, 5], [9]]


@given(first=page_lists, growth=page_lists)
def test_since_then_extended_rebuilds_the_lists(first, growth):
    """A receiver that applies every append-delta to what it has ends with the sender's lists."""
    before = GroupPages(first)
    width = max(len(first), len(growth))
    after = GroupPages((first[g] if g < len(first) else []) + (growth[g] if g < len(growth) else [])
                       for g in range(width))
    assert before.extended(after.since(before.lengths())) == after
    assert GroupPages().extended(after) == after
