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


@pytest.fixture
def in_use(tiny):
    """Two blocks and a partial one used by an open cache."""
    run_prompt(tiny, "a", list(range(10)))
    check_manager(tiny)
    return tiny


def _slots_in_use(manager):
    """Slots of the pages in use, ascending."""
    return manager.page_table.pages_in_use(0).tolist()


def _droppable_slots(manager):
    return manager.page_table.droppable(0).in_eviction_order().tolist()


def test_a_count_nobody_holds_is_caught(in_use):
    in_use.page_table.cells(0).num_held[_slots_in_use(in_use)[0]] = 1
    with pytest.raises(LogicError, match=r"counts \(active 1, held 1\) but caches and holds reference it"):
        check_manager(in_use)


def test_a_droppable_page_off_the_eviction_list_is_caught(closed):
    slot = _droppable_slots(closed)[1]
    closed.page_table.droppable(0)._generation[slot] += 1   # its eviction entry goes stale
    with pytest.raises(LogicError, match="eviction list and status disagree"):
        check_manager(closed)


def test_a_droppable_page_pointing_at_a_node_that_does_not_hold_it_is_caught(closed):
    cells = closed.page_table.cells(0)
    first, second = _droppable_slots(closed)[:2]
    closed.tree.pages[cells.node[second], 0] = -1
    cells.node[second] = cells.node[first]
    with pytest.raises(LogicError, match="points at a node that does not hold it"):
        check_manager(closed)


def test_a_page_in_use_pointing_at_a_node_that_does_not_hold_it_is_caught(in_use):
    cells = in_use.page_table.cells(0)
    first, second = _slots_in_use(in_use)[:2]
    in_use.tree.pages[cells.node[second], 0] = -1
    cells.node[second] = cells.node[first]
    with pytest.raises(LogicError, match="points at a node that does not hold it"):
        check_manager(in_use)


def test_a_node_holding_a_page_that_points_elsewhere_is_caught(in_use):
    cells = in_use.page_table.cells(0)
    first, second = _slots_in_use(in_use)[:2]
    cells.node[first] = cells.node[second]
    with pytest.raises(LogicError, match="disagree about each other"):
        check_manager(in_use)


def test_a_node_holding_a_droppable_page_that_points_elsewhere_is_caught(closed):
    cells = closed.page_table.cells(0)
    first, second = _droppable_slots(closed)[:2]
    cells.node[first] = cells.node[second]
    with pytest.raises(LogicError, match="which no page of its layer group owns"):
        check_manager(closed)


def test_a_freed_slot_still_droppable_is_caught(closed):
    slot = _droppable_slots(closed)[0]
    closed.page_table.allocators[0]._owned[slot] = 0
    with pytest.raises(LogicError, match="owned slots and page cells disagree"):
        check_manager(closed)


@pytest.mark.parametrize("corrupt, message", [
    (lambda t, n: t.num_children.__setitem__(n, t.num_children[n] + 1), "child count disagrees"),
    (lambda t, n: setattr(t, "_num_alive", t._num_alive + 1), "count of live nodes"),
    (lambda t, n: t.parent.__setitem__(n, 999), "parent is not a live full block"),
    (lambda t, n: t._first_child.__setitem__(t.parent[n], -1), "sibling list is not linked"),
    (lambda t, n: t.depth.__setitem__(n, 7), "one level up"),
])
def test_the_trees_own_bookkeeping_is_checked(closed, corrupt, message):
    tree = closed.tree
    node = next(n for n in tree.nodes() if tree.parent[n] != -1)   # a block, not a root
    corrupt(tree, node)
    with pytest.raises(LogicError, match=message):
        check_manager(closed)


def test_two_children_holding_the_same_tokens_are_caught(tiny):
    run_prompt(tiny, "a", list(range(10))).close()
    run_prompt(tiny, "b", [0, 1, 2, 3, 40, 41, 42, 43, 44]).close()   # block 1 differs: a sibling
    tree = tiny.tree
    first, second = (n for n in tree.nodes() if tree.depth[n] == 2 and tree.is_full(n))
    tree.tokens[second] = tree.tokens[first]
    with pytest.raises(LogicError, match="not the one child of its parent holding its tokens"):
        check_manager(tiny)


def test_a_droppable_page_listed_under_another_priority_is_caught(closed):
    closed.page_table.cells(0).priority[_droppable_slots(closed)[0]] += 1
    with pytest.raises(LogicError, match="eviction list and status disagree"):
        check_manager(closed)


def test_a_node_holding_a_slot_outside_its_pool_is_caught(closed):
    node = next(n for n in closed.tree.nodes() if closed.tree.pages[n, 0] >= 0)
    closed.tree.pages[node, 0] = closed.page_table.allocators[0].num_slots + 3
    with pytest.raises(LogicError, match="outside its pool"):
        check_manager(closed)
