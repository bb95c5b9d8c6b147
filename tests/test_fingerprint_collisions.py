"""Fingerprints only say where to look: a tree whose fingerprints collide all the time (four
values in all) finds, adds and prunes exactly the blocks a plain dict keyed by (parent, tokens)
does, and a manager built on it decides exactly what one with real fingerprints decides."""

from __future__ import annotations

from typing import Sequence

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.manager.block_keys import ReuseScope
from kvtool.manager.fingerprints import Fingerprinter
from kvtool.manager.radix_tree import NO_NODE, RadixTree
from tests.test_page_batching import operation, replay

TPB = 2


class CollidingFingerprinter(Fingerprinter):
    """A consistent chained fingerprint with four values: (previous + sum of tokens + length) % 4."""

    def full_blocks(self, previous: int, tokens: np.ndarray) -> np.ndarray:
        out, count = [], len(tokens) // self.tokens_per_block
        for k in range(count):
            previous = self.block(previous, tokens[k * self.tokens_per_block:(k + 1) * self.tokens_per_block])
            out.append(previous)
        return np.array(out, dtype=np.uint64)

    def block(self, previous: int, tokens: Sequence[int]) -> int:
        return (previous + sum(int(t) for t in tokens) + len(tokens)) % 4

    def one_step(self, previous: np.ndarray, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        width = np.arange(tokens.shape[1])
        sums = np.where(width < lengths[:, None], tokens, 0).astype(np.uint64).sum(axis=1)
        return (previous + sums + lengths.astype(np.uint64)) % np.uint64(4)


def colliding_tree() -> RadixTree:
    tree = RadixTree(TPB, expected_nodes=4)
    tree.fingerprints = CollidingFingerprinter(TPB)
    return tree


chain_step = st.tuples(st.integers(0, 30), st.lists(st.integers(0, 1), min_size=TPB, max_size=5 * TPB),
                       st.booleans())


@settings(max_examples=80, deadline=None)
@given(st.lists(chain_step, min_size=1, max_size=25))
def test_a_colliding_tree_holds_what_a_dict_of_parent_and_tokens_holds(steps):
    tree = colliding_tree()
    root = tree.root(ReuseScope())
    tree.num_users[root] += 1
    model: dict[tuple[int, tuple[int, ...]], int] = {}
    for pick, tokens, prune in steps:
        full = [root] + [n for (_, t), n in model.items() if len(t) == TPB]
        parent = full[pick % len(full)]
        blocks = np.array(tokens[:len(tokens) - len(tokens) % TPB], dtype=np.uint32)
        fingerprints = tree.fingerprints.full_blocks(int(tree.fingerprint[parent]), blocks)
        expected, at = [], parent
        for k in range(len(blocks) // TPB):
            at = model.get((at, tuple(blocks[k * TPB:(k + 1) * TPB].tolist())), NO_NODE)
            if at == NO_NODE:
                break
            expected.append(at)
        assert tree.find_chain(parent, blocks, fingerprints).tolist() == expected
        chain = tree.extend(parent, blocks, fingerprints).tolist()
        assert chain[:len(expected)] == expected
        for k, node in enumerate(chain):
            model[(chain[k - 1] if k else parent, tuple(blocks[k * TPB:(k + 1) * TPB].tolist()))] = node
        if len(tokens) % TPB:   # a partial leaf after the chain
            leaf_parent = chain[-1] if chain else parent
            leaf = tuple(tokens[-(len(tokens) % TPB):])
            node = tree.get_or_insert(leaf_parent, leaf)
            assert model.setdefault((leaf_parent, leaf), node) == node
            chain = chain + [node]
        if prune:
            tree.prune_many(np.array(chain, dtype=np.int64))
            alive = {key: node for key, node in model.items() if tree.is_alive(node)}
            model = alive
        else:
            tree.num_users[chain] += 1
    assert tree.structure_problem() is None
    assert len(tree) == len(model) + 1


@settings(max_examples=40, deadline=None)
@given(operations=st.lists(operation, min_size=1, max_size=40), num_slots=st.integers(12, 30),
       model=st.sampled_from(["tiny", "tiny-vswa"]))
def test_a_manager_on_colliding_fingerprints_decides_the_same(operations, num_slots, model):
    assert replay(operations, model, False, num_slots) == \
        replay(operations, model, False, num_slots, fingerprinter=CollidingFingerprinter)
