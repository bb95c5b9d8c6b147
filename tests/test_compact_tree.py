"""The array-backed tree's parts against plain Python models: the fingerprint index against a
set, a prompt's fingerprints at once against the chain of single blocks, the droppable pages'
eviction order against OrderedDicts per priority, and the tree's partial matches (wide nodes
listed by first token included) against a brute-force scan of the children in insertion order."""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.errors import OutOfPagesError
from kvtool.manager.block_keys import ReuseScope
from kvtool.manager.droppable import DroppablePages
from kvtool.manager.fingerprint_index import EMPTY, FingerprintIndex
from kvtool.manager.fingerprints import Fingerprinter
from kvtool.manager.page_cells import PageCells
from kvtool.manager.radix_tree import RadixTree

FINGERPRINTS = [int.from_bytes(hashlib.sha256(str(i).encode()).digest()[:8], "little") for i in range(40)]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "remove", "find"]), st.lists(st.integers(0, 199), max_size=40)),
                max_size=30))
def test_the_fingerprint_index_finds_what_a_dict_would(operations):
    """Ids 0..199 with 40 fingerprints among them (five ids a fingerprint): `first_many` answers
    one id holding the fingerprint, `all_of` every one, `contains_many` exactly the ids in the set."""
    values = np.array([FINGERPRINTS[i % 40] for i in range(200)], dtype=np.uint64)
    index, model = FingerprintIndex(values, 16), set()
    for op, picks in operations:
        picks = list(dict.fromkeys(picks))
        if op == "add":
            index.add_many(np.array([i for i in picks if i not in model], dtype=np.int64))
            model.update(picks)
        elif op == "remove":
            index.remove_many(np.array([i for i in picks if i in model], dtype=np.int64))
            model.difference_update(picks)
        for i, first in zip(picks, index.first_many(values[picks]).tolist()):
            holders = {j for j in model if values[j] == values[i]}
            assert (first in holders) if holders else first == EMPTY
            assert set(index.all_of(int(values[i]))) == holders
        assert index.contains_many(np.array(picks, dtype=np.int64)).tolist() == [i in model for i in picks]
        assert len(index) == len(model) and sorted(index.ids().tolist()) == sorted(model)


def test_an_id_removed_is_not_found_and_its_cell_is_reused():
    values = np.array(FINGERPRINTS[:8], dtype=np.uint64)
    index = FingerprintIndex(values, 16)
    index.add_many(np.arange(3))
    index.remove_many(np.array([1]))
    assert index.first_many(values[:3]).tolist() == [0, EMPTY, 2]
    index.add_many(np.array([7]))
    assert index.first_many(values[[7, 1]]).tolist() == [7, EMPTY]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.lists(st.integers(0, 2**32 - 1), max_size=40), st.integers(0, 2**64 - 1))
def test_a_prompts_fingerprints_at_once_are_the_chain_of_single_blocks(tpb, tokens, root):
    fingerprinter = Fingerprinter(tpb)
    at_once = fingerprinter.full_blocks(root, np.array(tokens, dtype=np.uint32)).tolist()
    one_by_one, previous = [], root
    for start in range(0, len(tokens) - tpb + 1, tpb):
        previous = fingerprinter.block(previous, tokens[start:start + tpb])
        one_by_one.append(previous)
    assert at_once == one_by_one
    if one_by_one:
        rows = np.array(tokens[:len(one_by_one) * tpb], dtype=np.uint32).reshape(-1, tpb)
        parents = np.array([root, *one_by_one[:-1]], dtype=np.uint64)
        assert fingerprinter.one_step(parents, rows, np.full(len(rows), tpb)).tolist() == one_by_one


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["release", "take", "evict"]), st.integers(0, 15), st.integers(0, 2)),
                max_size=60))
def test_droppable_pages_are_evicted_lowest_priority_then_oldest_first(operations):
    cells = PageCells(16)
    droppable, model = DroppablePages(cells), {}
    for op, slot, priority in operations:
        listed = any(slot in bucket for bucket in model.values())
        if op == "release" and not listed:
            cells.node[slot], cells.priority[slot] = 100 + slot, priority
            droppable.add(np.array([slot]))
            model.setdefault(priority, OrderedDict())[slot] = None
        elif op == "take" and listed:
            droppable.take_many(np.array([slot]))
            next(b for b in model.values() if slot in b).pop(slot)
        elif op == "evict":
            order = [s for p in sorted(model) for s in model[p]]
            if slot > len(order):
                with pytest.raises(OutOfPagesError):
                    droppable.evict(slot)
                continue
            evicted = droppable.evict(slot)
            assert evicted.slots.tolist() == order[:slot] and evicted.nodes.tolist() == [100 + s for s in order[:slot]]
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
        node = tree.get_or_insert(root, tokens)
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


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6), st.booleans()), min_size=1, max_size=20))
def test_chains_added_and_pruned_keep_their_parents_tokens_and_keys(operations):
    """Chains grow from random points of earlier ones (`extend`), some are pruned at once, so
    later chains take recycled ids in no particular order; every live node must still name its
    parent and hold its tokens."""
    tpb = 2
    tree = RadixTree(tpb, expected_nodes=4)
    root = tree.root(ReuseScope())
    tree.num_users[root] += 1   # pinned, as a cache chaining through a node pins it
    model: dict[int, tuple[int, tuple[int, ...]]] = {}   # node -> (parent, tokens)
    chains: list[list[int]] = []
    for serial, (branch, length, prune) in enumerate(operations):
        base = chains[branch % len(chains)] if chains else []
        parent = base[len(base) // 2] if base and tree.is_alive(base[len(base) // 2]) else root
        tokens = np.arange(serial * 100, serial * 100 + length * tpb, dtype=np.uint32)
        fingerprints = tree.fingerprints.full_blocks(int(tree.fingerprint[parent]), tokens)
        chain = tree.extend(parent, tokens, fingerprints).tolist()
        for b, node in enumerate(chain):
            model[node] = (chain[b - 1] if b else parent, tuple(tokens[b * tpb:(b + 1) * tpb].tolist()))
        if prune:
            tree.prune_many(np.array(chain))
            for node in chain:
                model.pop(node)
        else:
            tree.num_users[chain] += 1
            chains.append(chain)
    for node, (parent, tokens) in model.items():
        assert tree.is_alive(node) and int(tree.parent[node]) == parent and tree.block_tokens(node) == tokens
    assert len(tree) == len(model) + 1   # and the root
