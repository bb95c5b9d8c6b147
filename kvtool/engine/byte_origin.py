"""Whose bytes a wrong head holds: the fingerprint read backwards.

A head's first 8-byte word is `mix64(prefix_hash ^ key(layer, role, head)) ^ word_index * GOLD`
(`fingerprint`), and `mix64` is a bijection, so a word that is some other coordinate's fingerprint
can be traced: undo the mixer for each word index, xor each key the model has, and look the result
up among the prefix hashes of the requests this engine knows (live, and the last `REMEMBERED`
finished). `Origins.describe` says what differs from where the bytes belong: another request's
prompt, another position, layer, role or head, bytes shifted inside the head. Evidence such as
`found the bytes of position 4 (...)` names the connector's mistake (a block one off, a swapped
layer) where hex alone does not. `found_bytes` says a head's bytes in those words, or as a poison.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from kvtool.engine.fingerprint import FINGERPRINTED_ROLES, PrefixHashes, coordinate_keys, unmix64, word_prints
from kvtool.manager.manager import POISON_BYTE, RELEASED_POISON_BYTE
from kvtool.types import Role

REMEMBERED = 64
"""Finished requests whose hashes are kept: a connector serving a finished request's block is
traced (8 bytes a token each)."""
MAX_WORD_SHIFT = 32
"""Word indices tried: bytes shifted up to 248 bytes inside a head are traced."""
BUDGET_S = 2.0
"""Time an engine spends tracing, in all: past it, wrong bytes are shown as bytes only (a run with
thousands of wrong heads against long contexts stays as fast as before)."""


@dataclass(frozen=True)
class Coordinate:
    """Where a head's bytes belong: (request, position, layer, role, global head)."""

    request_id: int
    position: int
    layer_id: int
    role: Role
    head: int


@dataclass(frozen=True)
class _Origin:
    where: Coordinate
    shift: int
    """The word index the head's first word was written as (its bytes shifted by 8 x shift)."""


class Origins:
    """The prefix hashes of the requests an engine knows, and the keys of the model's coordinates.

    `live` is the engine's own map (request id -> hashes), read at each `describe`; `num_heads` the
    model's heads per buffer across every tensor-parallel rank."""

    def __init__(self, live: dict[int, PrefixHashes], layer_ids: list[int], num_heads: int) -> None:
        self._live = live
        self._finished: OrderedDict[int, np.ndarray] = OrderedDict()
        self._coordinates = [(layer, role, head) for layer in layer_ids for role in FINGERPRINTED_ROLES
                             for head in range(num_heads)]
        self._keys = np.concatenate([coordinate_keys(layer, role, num_heads)
                                     for layer in layer_ids for role in FINGERPRINTED_ROLES])
        self._sorted: dict[int, tuple[tuple[int, int], np.ndarray, np.ndarray]] = {}
        self._spent_s = 0.0

    def forget(self, request_id: int) -> None:
        """Keep a finished request's hashes (a connector may still serve its blocks); a padding
        dummy (negative id) is not kept."""
        hashes = self._live.get(request_id)
        if request_id >= 0 and hashes is not None and len(hashes):
            self._finished.pop(request_id, None)
            self._finished[request_id] = hashes.array().copy()    # the engine may truncate its own
            if len(self._finished) > REMEMBERED:
                self._finished.popitem(last=False)

    def describe(self, word: int, where: Coordinate) -> str | None:
        """What the head whose first word is `word` holds, said against `where` it belongs (e.g.
        `the bytes of position 4`); None when no known coordinate wrote it, when the only one is
        `where` itself unshifted (the caller compares such heads with what was expected), or when
        the tracing budget is spent."""
        if self._spent_s > BUDGET_S:
            return None
        started = time.perf_counter()
        try:
            origin = self._trace(word, where)
        finally:
            self._spent_s += time.perf_counter() - started
        return None if origin is None else _said(origin, where)

    def _trace(self, word: int, where: Coordinate) -> _Origin | None:
        """The known coordinate whose fingerprint is `word`, the closest to `where` when several
        are; word index 0 is tried first, the shifted ones only when it matches nothing."""
        prints = unmix64(word_prints(word, MAX_WORD_SHIFT))
        for shifts in (range(1), range(1, MAX_WORD_SHIFT)):
            candidates = (prints[shifts.start:shifts.stop, None] ^ self._keys[None, :]).ravel()
            matches = [self._at(request_id, flat // len(self._keys) + shifts.start, flat % len(self._keys), position)
                       for request_id, flat, position in self._matches(candidates)]
            matches = [m for m in matches if m.shift or m.where != where]
            if matches:
                return min(matches, key=lambda m: _distance(m, where))
        return None

    def _at(self, request_id: int, shift: int, coordinate: int, position: int) -> _Origin:
        layer, role, head = self._coordinates[coordinate]
        return _Origin(Coordinate(request_id, position, layer, role, head), shift)

    def _matches(self, candidates: np.ndarray):
        """(request id, candidate index, position) of each candidate that is a known prefix hash."""
        for request_id, (hashes, order) in self._known():
            at = np.searchsorted(hashes, candidates)
            found = np.nonzero(hashes[np.minimum(at, len(hashes) - 1)] == candidates)[0]
            for flat in found.tolist():
                yield request_id, flat, int(order[at[flat]])

    def _known(self):
        """(request id, (its hashes sorted, their positions)) of every known request, each sorted
        once per length and last hash (a rewound request that grew back differs in its last)."""
        arrays = [(rid, h.array()) for rid, h in self._live.items() if len(h)]
        arrays += [(rid, a) for rid, a in self._finished.items() if rid not in self._live]
        for request_id, array in arrays:
            signature = (len(array), int(array[-1]))
            cached = self._sorted.get(request_id)
            if cached is None or cached[0] != signature:
                order = np.argsort(array, kind="stable")
                cached = self._sorted[request_id] = (signature, array[order], order)
            yield request_id, cached[1:]
        for gone in set(self._sorted) - {rid for rid, _ in arrays}:
            del self._sorted[gone]


def _distance(origin: _Origin, where: Coordinate) -> tuple:
    """Which of several origins to name: its own request, its own layer, role and head, then the
    nearest position."""
    other = origin.where
    return (other.request_id != where.request_id,
            (other.layer_id, other.role, other.head) != (where.layer_id, where.role, where.head),
            abs(other.position - where.position))


def _said(origin: _Origin, where: Coordinate) -> str:
    """`the bytes of request 2, position 5, layer 1` (what differs from `where`), `, shifted by N bytes`."""
    other = origin.where
    own = other.request_id == where.request_id
    parts = [] if own else [f"request {other.request_id}"]
    if not own or other.position != where.position:
        parts.append(f"position {other.position}")
    if other.layer_id != where.layer_id:
        parts.append(f"layer {other.layer_id}")
    if other.role != where.role:
        parts.append(f"the {other.role.value}")
    if other.head != where.head:
        parts.append(f"head {other.head}")
    said = f"the bytes of {', '.join(parts)}" if parts else "its own bytes"
    return said + (f", shifted by {origin.shift * 8} bytes" if origin.shift else "")


_UNIFORM_MEANINGS = {POISON_BYTE: "a page that was never written since it was handed out",
                     RELEASED_POISON_BYTE: "a released page", 0: "zeros"}


def found_bytes(head: torch.Tensor, expected: torch.Tensor | None = None, origins: Origins | None = None,
                where: Coordinate | None = None) -> str:
    """What one head's bytes read back as, then its first 8 bytes in hex: what they mean when every
    byte is one of the manager's poisons or zero; else, when its first word is `expected`'s, where
    they first differ; else, given `origins`, whose bytes they are (`Origins.describe`)."""
    first8 = bytes(head[:8].cpu().tolist())
    first = int(head[0]) if head.numel() else None
    meaning = _UNIFORM_MEANINGS.get(first) if first is not None and bool((head == first).all()) else None
    if meaning is None and expected is not None and bytes(expected[:8].cpu().tolist()) == first8:
        wrong = int(torch.nonzero(head != expected)[0, 0]) if bool((head != expected).any()) else len(head)
        meaning = f"its own first bytes, wrong from byte {wrong} of the head"
    elif meaning is None and origins is not None and where is not None and len(first8) == 8:
        meaning = origins.describe(int(np.frombuffer(first8, dtype=np.uint64)[0]), where)
    return f"{meaning} ({first8.hex()})" if meaning else first8.hex()
