"""check_manager catches a corrupted manager, each kind of corruption with its own message (its
fast path over millions of pages must still name what is wrong)."""

import pytest

from kvtool.errors import LogicError
from kvtool.manager.integrity import check_manager
from tests.test_kv_cache import run_prompt


@pytest.fixture
def closed(tiny):
    """Two blocks and a partial leaf in the tree, droppable (their cache closed)."""
    run_prompt(tiny, "a", list(range(10))).close()
    check_manager(tiny)
    return tiny


def _pages(manager):
    return sorted(manager.page_table.pages_of(0).values(), key=lambda p: p.slot)


def test_a_count_nobody_holds_is_caught(closed):
    _pages(closed)[0].num_held = 1
    with pytest.raises(LogicError, match=r"counts \(active 0, held 1\) but caches and holds reference it"):
        check_manager(closed)


def test_a_droppable_page_off_the_eviction_list_is_caught(closed):
    page = _pages(closed)[1]
    closed.page_table._unlist_droppable(page)
    with pytest.raises(LogicError, match="eviction list and status disagree"):
        check_manager(closed)


def test_a_page_pointing_at_a_node_that_does_not_hold_it_is_caught(closed):
    first, second = _pages(closed)[:2]
    del second.node.pages[second.layer_group_id]
    second.node = first.node
    with pytest.raises(LogicError, match="points at a node that does not hold it"):
        check_manager(closed)


def test_a_node_holding_a_page_that_points_elsewhere_is_caught(closed):
    first, second = _pages(closed)[:2]
    first.node = second.node
    with pytest.raises(LogicError, match="disagree about each other"):
        check_manager(closed)
