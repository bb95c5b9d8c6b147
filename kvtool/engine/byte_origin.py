"""Whose bytes a wrong head holds: the fingerprint read backwards.

A head's first 8-byte word is `mix64(prefix_hash ^ key(layer, role, head)) ^ word_index * GOLD`
(`fingerprint`), and `mix64` is a bijection, so a word that is some other coordinate's fingerprint
can be traced: undo the mixer for each word index, xor each key the model has, and look the result
up among the prefix hashes of the requests this engine knows (live, and the last `REMEMBERED`
forgotten). `Origins.describe` says what differs from where the bytes belong: another request's
prompt, another position, layer, role or head, bytes shifted inside the head. Evidence such as
`found the bytes of position 4 (...)` names the connector's mistake (a block one off, a swapped
layer) where hex alone does not.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from kvtool.engine.fingerprint import _GOLD, _M1, _M2, PrefixHashes, coordinate_keys
from kvtool.types import Role

REMEMBERED = 256
"""Forgotten requests whose hashes are kept: a connector serving a finished request's block is traced."""
MAX_WORD_SHIFT = 32
"""Word indices tried: bytes shifted up to 256 bytes inside a head are traced."""
_INV_M1 = np.uint64(pow(int(_M1), -1, 1 << 64))
_INV_M2 = np.uint64(pow(int(_M2), -1, 1 << 64))
_ROLES = (Role.KEY, Role.VALUE)


def unmix64(y: np.ndarray) -> np.ndarray:
    """The inverse of `fingerprint.mix64`, element-wise on uint64."""
    with np.errstate(over="ignore"):
        x = _unshift(y, 31) * _INV_M2
        x = _unshift(x, 27) * _INV_M1
        return _unshift(x, 30)


def _unshift(y: np.ndarray, shift: int) -> np.ndarray:
    """x such that x ^ (x >> shift) == y."""
    x = y.copy()
    for _ in range(64 // shift):
        x = y ^ (x >> np.uint64(shift))
    return x


@dataclass(frozen=True)
class Coordinate:
    """Where a head's bytes belong: (request, position, layer, role, global head)."""

    request_id: int
    position: int
    layer_id: int
    role: Role
    head: int


class Origins:
    """The prefix hashes of the requests an engine knows, and the keys of the model's coordinates.

    `live` is the engine's own map (request id -> hashes), read at each `describe`."""

    def __init__(self, live: dict[int, PrefixHashes], layer_ids: list[int], num_heads: int) -> None:
        self._live = live
        self._forgotten: deque[tuple[int, np.ndarray]] = deque(maxlen=REMEMBERED)
        self._coordinates = [(layer, role, head) for layer in layer_ids for role in _ROLES for head in range(num_heads)]
        self._keys = np.concatenate([coordinate_keys(layer, role, num_heads) for layer in layer_ids for role in _ROLES])
        self._signature: tuple | None = None
        self._sorted: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def forget(self, request_id: int) -> None:
        """Keep a request's hashes after the engine forgets it (a connector may still serve its blocks)."""
        hashes = self._live.get(request_id)
        if hashes is not None and len(hashes):
            self._forgotten.append((request_id, hashes.array().copy()))

    def describe(self, word: int, where: Coordinate) -> str | None:
        """What the head whose first word is `word` holds, said against `where` it belongs (e.g.
        `the bytes of position 4`); None when no known coordinate wrote it."""
        found = self._trace(word, where)
        if found is None:
            return None
        (request_id, position, shift), (layer, role, head) = found
        own = request_id == where.request_id
        parts = [] if own else [f"request {request_id}"]
        if position != where.position or not own:
            parts.append(f"position {position}")
        parts += [f"layer {layer}"] * (layer != where.layer_id) + [f"the {role.value}"] * (role != where.role)
        parts += [f"head {head}"] * (head != where.head)
        said = f"the bytes of {', '.join(parts)}" if parts else "its own bytes"
        return said + (f", shifted by {shift * 8} bytes" if shift else "")

    def _trace(self, word: int, where: Coordinate):
        """((request, position, word shift), (layer, role, head)) of a coordinate whose fingerprint
        is `word`; the closest to `where` when several are (unshifted, its own request, its own
        layer, role and head, the nearest position first)."""
        shifts = np.arange(MAX_WORD_SHIFT, dtype=np.uint64)
        with np.errstate(over="ignore"):
            prints = np.uint64(word) ^ (shifts * np.uint64(_GOLD))
        candidates = (unmix64(prints)[:, None] ^ self._keys[None, :]).ravel()      # [shift x coordinate]
        hashes, owners, positions = self._index()
        low = np.searchsorted(hashes, candidates, side="left")
        high = np.searchsorted(hashes, candidates, side="right")
        best = None
        for flat in np.nonzero(high > low)[0].tolist():
            shift, coordinate = divmod(flat, len(self._keys))
            for i in range(int(low[flat]), int(high[flat])):
                request_id, position = int(owners[i]), int(positions[i])
                rank = (shift, request_id != where.request_id,
                        self._coordinates[coordinate] != (where.layer_id, where.role, where.head),
                        abs(position - where.position))
                if best is None or rank < best[0]:
                    best = (rank, (request_id, position, shift), self._coordinates[coordinate])
        return None if best is None else best[1:]

    def _index(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every known prefix hash, sorted, with its request id and position (rebuilt only when the
        known requests or their lengths changed)."""
        known = [(rid, hashes.array()) for rid, hashes in self._live.items() if len(hashes)] + list(self._forgotten)
        signature = tuple((rid, len(array)) for rid, array in known)
        if signature != self._signature:
            arrays = [array for _, array in known] or [np.zeros(0, dtype=np.uint64)]
            hashes = np.concatenate(arrays)
            owners = np.concatenate([np.full(len(a), rid, dtype=np.int64) for rid, a in known] or [np.zeros(0, np.int64)])
            positions = np.concatenate([np.arange(len(a), dtype=np.int64) for _, a in known] or [np.zeros(0, np.int64)])
            order = np.argsort(hashes, kind="stable")
            self._sorted = (hashes[order], owners[order], positions[order])
            self._signature = signature
        return self._sorted
