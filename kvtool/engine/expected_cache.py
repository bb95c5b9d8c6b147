"""The fake engine's expected bytes, kept per (request, layer) as they are computed.

Every pass verifies every earlier position a layer attends to, so without a cache each position's
fingerprints are recomputed once a pass: the hashing was most of validate's time. An expected byte is
a pure function of the position's prefix hash (and the layer's coordinates), so an entry stays exact
as long as the request's prefix hashes do; it is checked against them on every lookup, and where a
rewind (rejected drafts) changed them, recomputed from the first position that differs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

EXPECTED_CACHE_BYTES = 64 << 20
"""Bytes of expected fingerprints kept per fake engine; past it the cache starts again empty (a
real model's long prompts: each position of a layer is its whole KV), so memory stays bounded."""

Compute = Callable[[np.ndarray], list[torch.Tensor]]
"""Prefix hashes of some positions -> each buffer's expected bytes there, [positions, ...] uint8."""


@dataclass
class _Entry:
    hashes: np.ndarray
    """The prefix hashes of positions 0..n-1 the parts were computed from."""
    parts: list[torch.Tensor]
    """Each buffer's expected bytes of positions 0..n-1."""

    @property
    def nbytes(self) -> int:
        return sum(part.numel() * part.element_size() for part in self.parts)


class ExpectedBytesCache:
    """`at` returns what `compute` would for `hashes[positions]`, computing each position once."""

    def __init__(self, budget_bytes: int = EXPECTED_CACHE_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self._entries: dict[tuple[int, int], _Entry] = {}
        self._bytes = 0

    def at(self, request_id: int, layer_id: int, hashes: np.ndarray, positions: np.ndarray,
           compute: Compute) -> list[torch.Tensor]:
        """Each buffer's expected bytes at `positions` (non-empty, ascending without repeats, each
        < len(hashes)) of the request whose prefix hashes are `hashes`, for `layer_id`. Read-only:
        a run of consecutive positions is a view of the cache."""
        key = (request_id, layer_id)
        entry = self._entries.get(key)
        end = int(positions.max()) + 1
        valid = _common_prefix(entry.hashes, hashes) if entry is not None else 0
        if entry is None or valid < end:
            grown = compute(hashes[valid:end])
            parts = grown if entry is None or valid == 0 else \
                [torch.cat([old[:valid], new]) for old, new in zip(entry.parts, grown, strict=True)]
            entry = self._keep(key, _Entry(hashes[:end].copy(), parts))
            if entry is None:   # larger than the whole budget: not kept
                return _rows(parts, positions)
        return _rows(entry.parts, positions)

    def forget(self, request_id: int) -> None:
        for key in [k for k in self._entries if k[0] == request_id]:
            self._bytes -= self._entries.pop(key).nbytes

    def _keep(self, key: tuple[int, int], entry: _Entry) -> _Entry | None:
        old = self._entries.pop(key, None)
        self._bytes -= old.nbytes if old is not None else 0
        if entry.nbytes > self.budget_bytes:
            return None
        if self._bytes + entry.nbytes > self.budget_bytes:
            self._entries.clear()
            self._bytes = 0
        self._entries[key] = entry
        self._bytes += entry.nbytes
        return entry


def _rows(parts: list[torch.Tensor], positions: np.ndarray) -> list[torch.Tensor]:
    first, count = int(positions[0]), len(positions)
    if int(positions[-1]) - first + 1 == count:   # ascending without repeats: consecutive
        return [part[first:first + count] for part in parts]
    index = torch.from_numpy(positions)
    return [part[index] for part in parts]


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading hashes `a` and `b` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n
