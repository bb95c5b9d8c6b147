"""The page table's batched paths (allocate_many, release_many, the callback-free eviction loop)
give exactly the pages, slots and evictions that one call per page gives.

A manager with a page callback set (`poison_new_pages`) takes the one-call-per-page path; one
without takes the batched path. Hypothesis drives both through the same operations and compares
every cache's page indices, the eviction count and the eviction order after each step.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.manager import ReuseScope
from kvtool.types import KvCacheStatus
from tests.helpers.managers import make_manager

TPB = 4
PREFIXES = [[7] * 9, list(range(20, 34)), [5] * 23]

operation = st.one_of(
    st.tuples(st.just("create"), st.sampled_from(PREFIXES), st.integers(0, 9)),
    st.tuples(st.just("grow"), st.integers(0, 3), st.integers(1, 30)),
    st.tuples(st.just("close"), st.integers(0, 3), st.just(0)),
)


def replay(operations, model: str, poison: bool, num_slots: int) -> list:
    """Apply `operations` to a fresh manager; what it held after each one."""
    manager = make_manager(model, TPB, num_slots=num_slots, poison_new_pages=poison)
    caches, sequences, seen = [], [], []
    for kind, first, second in operations:
        open_caches = [i for i, c in enumerate(caches) if c.status is not KvCacheStatus.CLOSED]
        if kind == "create" and len(open_caches) < 4:
            prompt = first + [100 + second] * second
            cache = manager.create_kv_cache(len(caches), prompt[:-1], ReuseScope(), expected_prompt_length=len(prompt))
            cache.resume()
            caches.append(cache)
            sequences.append(prompt + list(range(200, 260)))
        elif kind == "grow" and open_caches:
            i = open_caches[first % len(open_caches)]
            cache = caches[i]
            capacity = min(cache.capacity + second, len(sequences[i]))
            if cache.resize(capacity):
                cache.commit(sequences[i][cache.num_committed_tokens:capacity])
        elif kind == "close" and open_caches:
            caches[open_caches[first % len(open_caches)]].close()
        table = manager.page_table
        seen.append(([c.get_page_indices(g.layer_group_id) for c in caches if c.status is not KvCacheStatus.CLOSED
                      for g in manager.layer_groups],
                     table.num_evictions,
                     [[p.slot for p in table.droppable_pages(pg)] for pg in range(len(table.allocators))]))
    return seen


@settings(max_examples=80, deadline=None)
@given(operations=st.lists(operation, min_size=1, max_size=40), num_slots=st.integers(12, 30),
       model=st.sampled_from(["tiny", "tiny-vswa"]))
def test_batched_and_per_page_paths_agree(operations, num_slots, model):
    assert replay(operations, model, False, num_slots) == replay(operations, model, True, num_slots)


def test_a_long_prefill_evicts_in_release_order():
    """Twelve blocks cached, then one prefill needing all twenty slots: the batch takes the eight
    free slots, then evicts the cached blocks last-block-first, as twenty single allocations would."""
    for poison in (False, True):
        manager = make_manager("tiny", TPB, num_slots=20, poison_new_pages=poison)
        first = manager.create_kv_cache(0, [], ReuseScope(), expected_prompt_length=48)
        first.resume()
        assert first.resize(48)
        first.commit(list(range(48)))
        cached = first.get_page_indices(0)
        first.close()
        second = manager.create_kv_cache(1, [], ReuseScope(salt=1), expected_prompt_length=80)
        second.resume()
        assert second.resize(80)
        pages = second.get_page_indices(0)
        assert pages[:8] == list(range(12, 20))
        assert pages[8:] == list(reversed(cached))
        assert manager.page_table.num_evictions == 12
