"""The array-backed tree's parts against plain Python models: the key index against a dict, the
droppable pages' eviction order against OrderedDicts per priority, and the tree's partial
matches (wide nodes listed by first token included) against a brute-force scan of the children
in insertion order."""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.errors import OutOfPagesError
from kvtool.manager.block_keys import ReuseScope, block_key
from kvtool.manager.droppable import DroppablePages
from kvtool.manager.key_index import EMPTY, KeyIndex, keys_array
from kvtool.manager.radix_tree import RadixTree

KEYS = [hashlib.sha256(str(i).encode()).digest() for i in range(400)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "remove", "find"]), st.lists(st.integers(0, 399), max_size=40)),
                max_size=30))
def test_the_key_index_finds_what_a_dict_would(operations):
    index, model, next_id = KeyIndex(16), {}, 0
    for op, picks in operations:
        picks = list(dict.fromkeys(picks))
        if op == "add":
            new = [k for k in picks if k not in model]
            ids = np.arange(next_id, next_id + len(new))
            index.add_many(ids, keys_array([KEYS[k] for k in new]))
            model.update(zip(new, ids.tolist()))
            next_id += len(new)
        elif op == "remove":
            gone = [k for k in picks if k in model]
            index.remove_many(np.array([model.pop(k) for k in gone], dtype=np.int64))
        found = index.find_many(keys_array([KEYS[k] for k in picks])).tolist()
        assert found == [model.get(k, EMPTY) for k in picks]
        assert len(index) == len(model)
        assert sorted(index.ids().tolist()) == sorted(model.values())


def test_a_key_removed_is_not_found_and_its_cell_is_reused():
    index = KeyIndex(16)
    index.add_many(np.arange(3), keys_array(KEYS[:3]))
    index.remove_many(np.array([1]))
    assert index.find_many(keys_array(KEYS[:3])).tolist() == [0, EMPTY, 2]
    index.add_many(np.array([1]), keys_array([KEYS[7]]))
    assert index.find(KEYS[7]) == 1 and index.find(KEYS[1]) == EMPTY


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["release", "take", "evict"]), st.integers(0, 15), st.integers(0, 2)),
                max_size=60))
def test_droppable_pages_are_evicted_lowest_priority_then_oldest_first(operations):
    droppable, model = DroppablePages(16), {}
    for op, slot, priority in operations:
        listed = any(slot in bucket for bucket in model.values())
        if op == "release" and not listed:
            droppable.add([slot], [100 + slot], [0], [priority])
            model.setdefault(priority, OrderedDict())[slot] = None
        elif op == "take" and listed:
            priority = next(p for p, b in model.items() if slot in b)
            assert droppable.take_many(np.array([slot])) == [(100 + slot, priority)]
            next(b for b in model.values() if slot in b).pop(slot)
        elif op == "evict":
            order = [s for p in sorted(model) for s in model[p]]
            if slot > len(order):
                with pytest.raises(OutOfPagesError):
                    droppable.evict(slot)
                continue
            assert droppable.evict(slot).slots.tolist() == order[:slot]
            for s in order[:slot]:
                next(b for b in model.values() if s in b).pop(s)
        assert droppable.in_eviction_order().tolist() == [s for p in sorted(model) for s in model[p]]
        assert len(droppable) == sum(len(b) for b in model.values()) and droppable.eviction_list_agrees()


def _common(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4), min_size=1, max_size=14),
       st.lists(st.integers(0, 13), max_size=6), st.lists(st.integers(0, 3), min_size=1, max_size=4))
def test_a_partial_match_is_the_first_inserted_longest_common_prefix(blocks, pruned, chunk):
    tpb = 4
    tree = RadixTree(tpb)
    root = tree.root(ReuseScope())
    children = {}
    for tokens in blocks:
        node = tree.get_or_insert(root, tokens, block_key(tree.key(root), tokens))
        children.setdefault(node, tokens)
    for k in pruned:
        node = list(children)[k % len(children)] if children else None
        if node is not None:
            tree.prune(node)
            children.pop(node)
    assert tree.children(root) == list(children) if children else True
    best = None
    for node, tokens in children.items():
        common = _common(tokens, chunk)
        if common == len(chunk) == tpb == len(tokens):
            continue
        if common and (best is None or common > best[1]):
            best = (node, common)
    assert tree.best_partial(root, chunk) == best
