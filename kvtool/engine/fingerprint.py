"""Fingerprints: what a full recompute would have written at each KV coordinate.

The prefix hash of position p chains the tokens [0, p]; the fingerprint of (position, layer, role,
head) mixes that hash with the coordinates, and fills the head's bytes with distinct 8-byte words.
A block in the wrong slot, a swapped layer, role or head, or bytes shifted inside a head all read
back as a mismatch, and the coordinates say where.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from kvtool.blocks import ceil_div
from kvtool.types import Role

_MASK = (1 << 64) - 1
_GOLD = 0x9E3779B97F4A7C15
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_ROLE_INDEX = {Role.KEY: 1, Role.VALUE: 2}
FINGERPRINTED_ROLES = tuple(_ROLE_INDEX)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, element-wise on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


_INV_M1 = np.uint64(pow(int(_M1), -1, 1 << 64))
_INV_M2 = np.uint64(pow(int(_M2), -1, 1 << 64))


def unmix64(y: np.ndarray) -> np.ndarray:
    """The inverse of `mix64` (each of its steps is a bijection on 64-bit words), element-wise."""
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


def word_prints(word: int, num_words: int) -> np.ndarray:
    """The fingerprints a head's 8-byte `word` would be if it were word 0, 1, ... of its head
    (`expected_bytes` xors word i with i * GOLD)."""
    with np.errstate(over="ignore"):
        return np.uint64(word) ^ (np.arange(num_words, dtype=np.uint64) * np.uint64(_GOLD))


def _mix_int(x: int) -> int:
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class PrefixHashes:
    """h[p] = mix(h[p-1] xor (token_p + gold)), extended as a request's tokens grow."""

    def __init__(self, seed: int = 0) -> None:
        self._start = self._state = _mix_int(seed & _MASK)
        self._hashes: list[int] = []
        self._array = np.zeros(0, dtype=np.uint64)

    def __len__(self) -> int:
        return len(self._hashes)

    def extend_to(self, tokens: Sequence[int]) -> None:
        for token in tokens[len(self._hashes):]:
            self._state = _mix_int(self._state ^ ((token + _GOLD) & _MASK))
            self._hashes.append(self._state)

    def truncate(self, length: int) -> None:
        """Keep the first `length` hashes (drafts a verify pass hashed may have been rejected)."""
        if length < len(self._hashes):
            del self._hashes[length:]
            self._state = self._hashes[-1] if self._hashes else self._start
            self._array = self._array[:length]   # the cache is keyed by length: never serve a draft's hash

    def array(self) -> np.ndarray:
        if len(self._array) != len(self._hashes):
            self._array = np.array(self._hashes, dtype=np.uint64)
        return self._array


def coordinate_keys(layer_id: int, role: Role, num_heads: int, first_head: int = 0) -> np.ndarray:
    """Keys of global heads [first_head, first_head + num_heads): a tensor-parallel shard's bytes
    are exactly its slice of the whole model's, so a rank holding another rank's heads is caught.
    Read-only: one array per coordinate set, computed once."""
    return _coordinate_keys(int(layer_id), role, int(num_heads), int(first_head))


@functools.lru_cache(maxsize=4096)
def _coordinate_keys(layer_id: int, role: Role, num_heads: int, first_head: int) -> np.ndarray:
    base = (layer_id << 24) | (_ROLE_INDEX[role] << 16)
    keys = mix64(np.arange(first_head, first_head + num_heads, dtype=np.uint64) | np.uint64(base))
    keys.flags.writeable = False
    return keys


@functools.lru_cache(maxsize=256)
def _word_salts(num_words: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        salts = np.arange(num_words, dtype=np.uint64) * np.uint64(_GOLD)
    salts.flags.writeable = False
    return salts


def expected_bytes(prefix_hashes: np.ndarray, layer_id: int, role: Role, num_heads: int,
                   head_bytes: int, first_head: int = 0) -> np.ndarray:
    """uint8 [positions, heads, head_bytes]: the fingerprint bytes of those positions."""
    keys = coordinate_keys(layer_id, role, num_heads, first_head)
    fingerprints = mix64(prefix_hashes[:, None] ^ keys[None, :])
    num_words = ceil_div(head_bytes, 8)
    words = fingerprints[:, :, None] ^ _word_salts(num_words)[None, None, :]
    raw = words.view(np.uint8).reshape(len(prefix_hashes), num_heads, num_words * 8)
    return raw[:, :, :head_bytes]


def sample_token(last_prefix_hash: int, checksum: int, vocab_size: int) -> int:
    """The next token: a function of the prefix and of the KV bytes the last position attended to."""
    return _mix_int((last_prefix_hash ^ (checksum & _MASK)) & _MASK) % vocab_size


def mix_int(x: int) -> int:
    """The 64-bit mixer, for other modules that derive reproducible values from ids."""
    return _mix_int(x & _MASK)
