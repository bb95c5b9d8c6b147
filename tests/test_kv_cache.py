"""Exact page ids, stale ranges, eviction order and the per-request cache's contract."""

import pytest

from kvtool.errors import LogicError, OutOfPagesError
from kvtool.manager import ReuseScope
from kvtool.manager.integrity import check_manager
from kvtool.manager.layer_groups import plan_layer_groups
from kvtool.manager.manager import POISON_BYTE, RELEASED_POISON_BYTE
from kvtool.models import load_model
from kvtool.types import BAD_PAGE_INDEX, KvCacheStatus, PageStatus
from tests.helpers.managers import make_manager

B = BAD_PAGE_INDEX


def run_prompt(manager, cache_id, tokens, scope=ReuseScope(), priority=None):
    """Create, compute the whole prompt in one pass, commit it, and return the active cache."""
    kwargs = {} if priority is None else {"priority": priority}
    cache = manager.create_kv_cache(cache_id, tokens[:-1], scope, expected_prompt_length=len(tokens), **kwargs)
    cache.resume()
    assert cache.resize(len(tokens), cache.history_length)
    cache.commit(tokens[cache.num_committed_tokens:])
    return cache


@pytest.mark.parametrize("history, expected", [
    (0, (0, 0)), (7, (0, 0)), (8, (0, 0)), (11, (0, 1)), (16, (0, 2)), (30, (0, 5)),
])
def test_stale_range_without_sinks(history, expected):
    sliding = plan_layer_groups(load_model("tiny-vswa"), 4)[0]   # window 8, 4 tokens per block
    r = sliding.stale_range(history, 4)
    assert (r.start, r.stop) == expected


def test_stale_range_keeps_sink_blocks_and_full_attention_has_none():
    groups = plan_layer_groups(load_model("tiny-vswa"), 4)
    sink = type(groups[0])(**{**groups[0].__dict__, "num_sink_tokens": 5})   # 2 sink blocks
    assert (sink.stale_range(30, 4).start, sink.stale_range(30, 4).stop) == (2, 5)
    assert (sink.stale_range(3, 4).start, sink.stale_range(3, 4).stop) == (1, 1)
    assert len(groups[1].stale_range(1000, 4)) == 0


def test_new_cache_is_suspended_and_empty(tiny):
    cache = tiny.create_kv_cache("a", [1, 2, 3])
    assert cache.status is KvCacheStatus.SUSPENDED
    assert (cache.capacity, cache.history_length, cache.num_committed_tokens) == (0, 0, 0)


def test_resize_allocates_from_the_head_of_the_free_list(tiny):
    cache = run_prompt(tiny, "a", list(range(10)))
    assert cache.get_page_indices(0) == [0, 1, 2]
    assert (cache.capacity, cache.history_length, cache.num_committed_tokens) == (10, 10, 10)
    check_manager(tiny)


def test_resize_contract_errors(tiny):
    cache = tiny.create_kv_cache("a", [])
    with pytest.raises(LogicError, match="needs ACTIVE"):
        cache.resize(4)
    cache.resume()
    assert cache.resize(8, 4)
    with pytest.raises(LogicError, match="decrease history_length"):
        cache.resize(8, 3)
    with pytest.raises(LogicError, match="above capacity"):
        cache.resize(8, 9)
    with pytest.raises(LogicError, match="past capacity"):
        cache.commit(list(range(9)))


def test_failed_resize_changes_nothing(tiny):
    run_prompt(tiny, "a", list(range(20)))           # 5 of 8 slots stay in use
    other = tiny.create_kv_cache("b", [])
    other.resume()
    assert not other.resize(16)                       # needs 4, 3 are free
    assert (other.capacity, other.history_length, other.get_page_indices(0)) == (0, 0, [])
    assert other.resize(12) and other.get_page_indices(0) == [5, 6, 7]
    check_manager(tiny)


def test_reuse_shares_full_blocks_and_copies_the_partial_one(tiny):
    tokens = list(range(10))
    first = run_prompt(tiny, "a", tokens)
    first.close()                                     # blocks 0,1 full, block 2 a partial leaf [8, 9]
    second = tiny.create_kv_cache("b", tokens[:-1])
    assert (second.capacity, second.history_length, second.num_committed_tokens) == (9, 9, 9)
    assert second.get_page_indices(0) == [0, 1, 2]
    second.resume()
    assert second.resize(10)
    assert second.get_page_indices(0) == [0, 1, 3]  # block 2 copied on write into slot 3
    region = tiny.layout.group(0).regions[0].as_tensor()
    assert region[3].equal(region[2])
    check_manager(tiny)


def test_partial_reuse_of_a_full_block(tiny):
    run_prompt(tiny, "a", list(range(12))).close()
    cache = tiny.create_kv_cache("b", list(range(10)) + [99])
    assert cache.num_committed_tokens == 10 and cache.get_page_indices(0) == [0, 1, 2]


def test_salt_isolates_reuse(tiny):
    tokens = list(range(9))
    run_prompt(tiny, "a", tokens, ReuseScope.from_cache_salt("alice")).close()
    assert tiny.create_kv_cache("b", tokens, ReuseScope.from_cache_salt("bob")).num_committed_tokens == 0
    assert tiny.create_kv_cache("c", tokens, ReuseScope.from_cache_salt("alice")).num_committed_tokens == 9
    assert tiny.create_kv_cache("d", tokens, ReuseScope(lora_id=3)).num_committed_tokens == 0


def test_eviction_is_lru_and_later_blocks_go_first(tiny):
    run_prompt(tiny, "a", list(range(12))).close()          # slots 0,1,2 cached
    run_prompt(tiny, "b", list(range(100, 112))).close()    # slots 3,4,5 cached
    assert [p.slot for p in tiny.page_table.droppable_pages(0)] == [2, 1, 0, 5, 4, 3]
    cache = tiny.create_kv_cache("c", [])
    cache.resume()
    assert cache.resize(16)                                  # 2 free, then evicts 2 and 1
    assert cache.get_page_indices(0) == [6, 7, 2, 1]
    assert tiny.create_kv_cache("d", list(range(12))).num_committed_tokens == 4   # only block 0 left
    check_manager(tiny)


def test_eviction_takes_the_lowest_priority_first(tiny):
    run_prompt(tiny, "a", list(range(8)), priority=90).close()   # slots 0,1, high priority
    run_prompt(tiny, "b", list(range(50, 58)), priority=10).close()  # slots 2,3, low priority
    assert [p.slot for p in tiny.page_table.droppable_pages(0)] == [3, 2, 1, 0]
    cache = tiny.create_kv_cache("c", [])
    cache.resume()
    assert cache.resize(28)                                  # 4 free + 3 evicted
    assert cache.get_page_indices(0) == [4, 5, 6, 7, 3, 2, 1]


def test_out_of_pages_when_nothing_is_evictable(tiny):
    run_prompt(tiny, "a", list(range(32)))
    with pytest.raises(OutOfPagesError):
        tiny.page_table.allocate(0, active=True)


def test_page_status_follows_its_users(tiny):
    cache = run_prompt(tiny, "a", list(range(8)))
    slot = int(cache.page_slots(0)[0])
    assert tiny.page_table.status(0, slot) is PageStatus.LOCKED
    cache.suspend()
    assert tiny.page_table.status(0, slot) is PageStatus.HELD
    cache.resume()
    hold = tiny.hold_pages(cache)
    cache.close()
    assert tiny.page_table.status(0, slot) is PageStatus.HELD and tiny.num_free_slots(0) == 6
    check_manager(tiny)
    hold.release()
    assert tiny.page_table.status(0, slot) is PageStatus.DROPPABLE
    check_manager(tiny)


def test_vswa_pages_stale_blocks_are_bad_and_scratch_is_reused(vswa):
    tokens = list(range(100, 130))   # 30 tokens: stale blocks 0..4 in the window-8 group at the end
    cache = vswa.create_kv_cache("a", tokens[:-1], expected_prompt_length=30)
    cache.resume()
    assert cache.resize(16)
    assert cache.get_page_indices(0) == [0, 1, 2, 3] and cache.get_page_indices(1) == [0, 1, 2, 3]
    cache.commit(tokens[:16])
    assert cache.resize(30, 16)
    # blocks 0,1 stale at 16; block 4 will be stale at 30 and reuses scratch slot 1
    assert cache.get_page_indices(0) == [B, B, 2, 3, 1, 4, 5, 6]
    assert cache.get_page_indices(1) == list(range(8))
    assert cache.scratch_slots(0) == [0]
    check_manager(vswa)
    cache.commit(tokens[16:])
    cache.close()
    check_manager(vswa)
    # scratch blocks never joined the tree: the sliding group holds blocks 5, 6, 7 only
    assert sorted(p.slot for p in vswa.page_table.droppable_pages(0)) == [4, 5, 6]


def test_vswa_without_scratch_reuse_gives_every_block_a_page(vswa):
    tokens = list(range(100, 130))
    cache = vswa.create_kv_cache("a", tokens[:-1], expected_prompt_length=30)
    cache.resume()
    assert cache.resize(16, scratch_reuse=False)
    cache.commit(tokens[:16])
    assert cache.resize(30, 16)
    assert cache.get_page_indices(0) == [B, B, 2, 3, 4, 5, 6, 7] and cache.scratch_slots(0) == []


def test_vswa_match_needs_only_the_window(vswa):
    tokens = list(range(100, 130))
    cache = vswa.create_kv_cache("a", tokens[:-1], expected_prompt_length=30)
    cache.resume()
    assert cache.resize(30, scratch_reuse=False)
    cache.commit(tokens)
    cache.close()
    again = vswa.create_kv_cache("b", tokens[:-1])
    assert again.num_committed_tokens == 29
    assert again.get_page_indices(0) == [B] * 5 + [5, 6, 7]     # stale blocks at 29 have no page
    assert again.get_page_indices(1) == list(range(8))


def test_vswa_match_falls_back_when_window_pages_are_missing(vswa):
    tokens = list(range(100, 130))
    run_prompt(vswa, "a", tokens).close()   # scratch reuse on: blocks 0..4 of the window group are missing
    # at 28 tokens the window needs blocks 5, 6 (present); at 20 it needs block 3 (a scratch block)
    assert vswa.create_kv_cache("b", tokens[:-1]).num_committed_tokens == 29
    assert vswa.create_kv_cache("c", tokens[:21] + [1, 2, 3]).num_committed_tokens == 0


def test_resize_of_a_windowed_group_releases_stale_pages(vswa):
    cache = vswa.create_kv_cache("a", [])
    cache.resume()
    assert cache.resize(16, scratch_reuse=False)
    cache.commit(list(range(16)))
    assert cache.resize(17)          # stale at 16: blocks 0, 1; they were never committed full? they were
    assert cache.get_page_indices(0) == [B, B, 2, 3, 4]
    assert sorted(p.slot for p in vswa.page_table.droppable_pages(0)) == [0, 1]
    check_manager(vswa)


def test_close_is_final(tiny):
    cache = run_prompt(tiny, "a", list(range(5)))
    cache.close()
    cache.close()
    assert cache.status is KvCacheStatus.CLOSED and tiny.caches == []
    with pytest.raises(LogicError):
        cache.resume()
    with pytest.raises(LogicError, match="closed"):
        cache.get_page_indices(0)


def test_integrity_check_finds_a_slot_owned_twice(tiny):
    cache = run_prompt(tiny, "a", list(range(8)))
    cache._pages[0][1] = cache._pages[0][0]
    with pytest.raises(LogicError):
        check_manager(tiny)


def test_integrity_check_finds_a_leaked_count(tiny):
    cache = run_prompt(tiny, "a", list(range(8)))
    tiny.page_table.cells(0).num_active[cache.page_slots(0)[0]] += 1
    with pytest.raises(LogicError, match="counts"):
        check_manager(tiny)


def test_integrity_check_finds_a_lost_slot(tiny):
    run_prompt(tiny, "a", list(range(8)))
    tiny.page_table.allocators[0]._next_fresh += 1   # the head of the free list: neither free nor owned now
    with pytest.raises(LogicError, match="total|disagree"):
        check_manager(tiny)


def test_integrity_check_finds_a_broken_cache_invariant(tiny):
    cache = run_prompt(tiny, "a", list(range(8)))
    cache._history = 3
    with pytest.raises(LogicError, match="num_committed_tokens"):
        check_manager(tiny)


def test_releasing_a_page_another_cache_still_uses_frees_nothing():
    from kvtool.manager import KvCacheManager, KvCacheManagerConfig
    from kvtool.models import DTYPES, build_model
    model = build_model("window-only", 2, 2, 16, DTYPES["bf16"], lambda i: 8)
    manager = KvCacheManager(KvCacheManagerConfig(model, 4, num_slots=7, device="cpu"))
    tokens = list(range(16))
    a = manager.create_kv_cache("a", [])
    a.resume()
    assert a.resize(16)
    a.commit(tokens)                                  # slots 0..3, still in use by a
    b = manager.create_kv_cache("b", tokens[:15])
    assert b.get_page_indices(0) == [B, B, 2, 3]      # shares a's blocks 2 and 3
    b.resume()
    # history 32 makes blocks 0..5 stale: b lets go of 2 and 3, but a keeps them; 4 new pages, 3 free
    assert not b.resize(40, 32)
    assert b.get_page_indices(0) == [B, B, 2, 3]
    check_manager(manager)
    a.close()                                         # 1, 0 droppable; then b drops 2 and 3 too
    assert b.resize(40, 32) and b.get_page_indices(0) == [B] * 6 + [4, 5, 6, 1]   # 3 free, evict LRU
    check_manager(manager)


def test_poisoning_covers_freed_slots_too():
    manager = make_manager(num_slots=8, poison_new_pages=True)
    cache = manager.create_kv_cache("a", [])
    cache.resume()
    assert cache.resize(6)                      # two blocks; the partial second one is never committed
    cache.commit(list(range(4)))
    (region,) = manager.layout.group(0).regions
    slot = cache.get_page_indices(0)[1]
    region.as_tensor()[slot].fill_(7)           # what the model wrote
    cache.close()                                # block 1 is partial: its slot goes back to the free list
    assert bool((region.as_tensor()[slot] == RELEASED_POISON_BYTE).all())
    assert RELEASED_POISON_BYTE != POISON_BYTE   # a page read after its release tells itself apart
    again = manager.create_kv_cache("b", [])
    again.resume()
    assert again.resize(4 * manager.num_free_slots(0)) and slot in again.get_page_indices(0)   # every free slot
    assert bool((region.as_tensor()[slot] == POISON_BYTE).all())   # handed out again: the hand-out poison
