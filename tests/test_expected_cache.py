"""The fake engine's expected-bytes cache returns exactly what computing afresh would, through
growth, rewinds (changed hashes) and a budget smaller than what it is asked to keep."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.engine.expected_cache import ExpectedBytesCache


def compute(hashes: np.ndarray) -> list[torch.Tensor]:
    """Two buffers' 'bytes' derived from each hash, as the fake engine's are: a pure function of it."""
    base = torch.from_numpy((hashes % 251).astype(np.uint8)).reshape(-1, 1, 1)
    return [base.expand(-1, 2, 3).clone(), (base + 1).expand(-1, 1, 4).clone()]


steps = st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(0, 3)), min_size=1, max_size=30)


@settings(max_examples=200, deadline=None)
@given(steps, st.sampled_from([1 << 20, 200]))
def test_every_lookup_equals_a_fresh_computation(ops, budget):
    cache = ExpectedBytesCache(budget_bytes=budget)
    hashes = {0: np.zeros(0, dtype=np.uint64), 1: np.zeros(0, dtype=np.uint64)}
    for length, keep, salt in ops:
        request = length % 2
        current = hashes[request][:min(keep, len(hashes[request]))]   # a rewind keeps a prefix
        fresh = np.arange(len(current), max(length, len(current) + 1), dtype=np.uint64) * 7919 + salt
        hashes[request] = np.concatenate([current, fresh])
        positions = np.unique(np.arange(len(hashes[request]))[::1 + salt])
        got = cache.at(request, 3, hashes[request], positions, compute)
        want = compute(hashes[request][positions])
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_each_position_is_computed_once_while_the_hashes_only_grow():
    cache, computed = ExpectedBytesCache(), []

    def counting(hashes):
        computed.append(len(hashes))
        return compute(hashes)
    hashes = np.arange(10, dtype=np.uint64)
    for end in (4, 4, 7, 10, 10):
        cache.at(5, 0, hashes[:end], np.arange(end), counting)
    assert computed == [4, 3, 3]
    cache.forget(5)
    cache.at(5, 0, hashes, np.arange(10), counting)
    assert computed == [4, 3, 3, 10]
