"""The array-backed tree's parts against plain Python models: the droppable pages' eviction order
against OrderedDicts per priority, the tree's partial matches (wide nodes listed by first token
included) against a brute-force scan of the children in insertion order, its blocks against a
dict keyed by (parent, tokens), and chains grown from recycled ids."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.errors import OutOfPagesError
from kvtool.manager.block_keys import ReuseScope
from kvtool.manager.droppable import DroppablePages
from kvtool.manager.page_cells import PageCells
from kvtool.manager.radix_tree import RadixTree


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
        chain = tree.extend(parent, tokens).tolist()
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


chain_step = st.tuples(st.integers(0, 30), st.lists(st.integers(0, 1), min_size=2, max_size=10), st.booleans())


@settings(max_examples=100, deadline=None)
@given(st.lists(chain_step, min_size=1, max_size=25))
def test_the_tree_holds_what_a_dict_of_parent_and_tokens_holds(steps):
    """Chains of two-token blocks over {0, 1} (equal blocks under many parents, wide nodes) grow
    from random full blocks, a partial leaf after some, and are pruned at once or kept: ids are
    recycled, so chains are seldom consecutive. `find_chain` finds exactly what walking a dict of
    (parent, tokens) -> node finds, and `extend` and `get_or_insert` add only what it lacks."""
    tpb = 2
    tree = RadixTree(tpb, expected_nodes=4)
    root = tree.root(ReuseScope())
    tree.num_users[root] += 1
    model: dict[tuple[int, tuple[int, ...]], int] = {}
    for pick, tokens, prune in steps:
        full = [root] + [n for (_, t), n in model.items() if len(t) == tpb]
        parent = full[pick % len(full)]
        blocks = np.array(tokens[:len(tokens) - len(tokens) % tpb], dtype=np.uint32)
        expected, at = [], parent
        for k in range(len(blocks) // tpb):
            at = model.get((at, tuple(blocks[k * tpb:(k + 1) * tpb].tolist())), -1)
            if at == -1:
                break
            expected.append(at)
        assert tree.find_chain(parent, blocks).tolist() == expected
        chain = tree.extend(parent, blocks).tolist()
        assert chain[:len(expected)] == expected and len(set(chain)) == len(chain)
        for k, node in enumerate(chain):
            model[(chain[k - 1] if k else parent, tuple(blocks[k * tpb:(k + 1) * tpb].tolist()))] = node
        if len(tokens) % tpb:
            leaf_parent, leaf = chain[-1] if chain else parent, tuple(tokens[-(len(tokens) % tpb):])
            node = tree.get_or_insert(leaf_parent, leaf)
            assert model.setdefault((leaf_parent, leaf), node) == node
            chain = chain + [node]
        if prune:
            tree.prune_many(np.array(chain, dtype=np.int64))
            model = {key: node for key, node in model.items() if tree.is_alive(node)}
        else:
            tree.num_users[chain] += 1
        assert tree.structure_problem() is None
    assert len(tree) == len(model) + 1 and sorted(tree.node_ids().tolist()) == sorted([root, *model.values()])
