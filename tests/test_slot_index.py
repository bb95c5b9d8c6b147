"""Eviction policies of a bounded tier (`kvtool.connectors.slot_index`): exact victims, and a
reference model of both policies under random operations."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.connectors.slot_index import LfuSlotIndex, SlotIndex, check_eviction, slot_index


def keys(index: SlotIndex) -> set[bytes]:
    return {k for k in (bytes([i]) for i in range(256)) if k in index}


def test_lru_evicts_the_least_recently_used():
    index = slot_index("lru", 2)
    index.reserve(b"a"), index.reserve(b"b")
    index.lookup(b"a")
    assert index.reserve(b"c") == 1 and keys(index) == {b"a", b"c"} and index.num_evictions == 1


def test_lfu_evicts_the_least_often_used_and_ties_go_to_the_least_recent():
    index = slot_index("lfu", 3)
    for key in (b"a", b"b", b"c"):
        index.reserve(key)
    index.lookup(b"a"), index.lookup(b"a"), index.lookup(b"c")      # uses: a 3, b 1, c 2
    assert index.reserve(b"d") == 1 and keys(index) == {b"a", b"c", b"d"}      # b: used once
    assert index.reserve(b"e") == 1 and keys(index) == {b"a", b"c", b"e"}      # d: once, and older than e
    index.lookup(b"e"), index.lookup(b"e")                           # e 3 (latest), a 3, c 2
    assert index.reserve(b"f") == 2 and keys(index) == {b"a", b"e", b"f"}      # c
    assert index.reserve(b"g") == 2 and keys(index) == {b"a", b"e", b"g"}      # f: once
    assert index.num_evictions == 4


def test_lfu_keeps_a_shared_prefix_that_lru_drops():
    """A system prompt's block looked up by every request survives a burst of one-off blocks under
    LFU; under LRU the burst pushes it out."""
    survived = {}
    for policy in ("lru", "lfu"):
        index = slot_index(policy, 3)
        index.reserve(b"S")
        for _ in range(5):
            index.lookup(b"S")
        for one_off in (b"1", b"2", b"3", b"4"):
            index.reserve(one_off)
        survived[policy] = b"S" in index
    assert survived == {"lru": False, "lfu": True}


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_pinned_slots_are_never_evicted(policy):
    index = slot_index(policy, 2)
    index.pin(index.reserve(b"a")), index.pin(index.reserve(b"b"))
    assert index.reserve(b"c") is None and keys(index) == {b"a", b"b"}
    index.unpin(0)
    assert index.reserve(b"c") == 0 and keys(index) == {b"b", b"c"}


def test_an_unknown_policy_is_named_with_the_choices():
    with pytest.raises(ValueError, match="eviction must be one of lru, lfu, got 'fifo'"):
        check_eviction("fifo")
    assert isinstance(slot_index("lfu", 1), LfuSlotIndex)


operations = st.lists(st.tuples(st.sampled_from(["reserve", "lookup", "pin", "unpin", "discard"]),
                                st.integers(0, 7)), max_size=120)


@settings(max_examples=150, deadline=None)
@given(policy=st.sampled_from(["lru", "lfu"]), num_slots=st.integers(1, 4), ops=operations)
def test_both_policies_match_a_reference_model(policy, num_slots, ops):
    """Slots stay unique and within the capacity, a pinned entry never leaves, and the victim is
    the unpinned key of the lowest rank: (last use) for LRU, (uses, last use) for LFU."""
    index = slot_index(policy, num_slots)
    uses: dict[bytes, int] = {}
    last: dict[bytes, int] = {}
    slot_of: dict[bytes, int] = {}
    pins: dict[int, int] = {}
    tick = 0

    def rank(key: bytes):
        return (uses[key], last[key]) if policy == "lfu" else last[key]

    for op, n in ops:
        key = bytes([n])
        tick += 1
        if op == "reserve":
            present = key in slot_of
            evictable = [k for k in slot_of if not pins.get(slot_of[k])]
            full = len(slot_of) >= num_slots and not present
            slot = index.reserve(key)
            if present or (full and not evictable and len(slot_of) >= num_slots):
                assert slot is None
                continue
            if full:
                victim = min(evictable, key=rank)
                assert victim not in index and slot == slot_of.pop(victim)
                del uses[victim], last[victim]
            assert slot is not None and slot not in slot_of.values()
            slot_of[key], uses[key], last[key] = slot, 1, tick
        elif op == "lookup":
            assert index.lookup(key) == slot_of.get(key)
            if key in slot_of:
                uses[key] += 1
                last[key] = tick
        elif op == "pin" and key in slot_of:
            index.pin(slot_of[key])
            pins[slot_of[key]] = pins.get(slot_of[key], 0) + 1
        elif op == "unpin" and key in slot_of and pins.get(slot_of[key]):
            index.unpin(slot_of[key])
            pins[slot_of[key]] -= 1
        elif op == "discard" and key in slot_of and not pins.get(slot_of[key]):
            index.discard(key)
            del slot_of[key], uses[key], last[key]
        assert len(index) == len(slot_of) <= num_slots
        assert all(k in index for k in slot_of)
