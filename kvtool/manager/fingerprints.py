"""Chained 64-bit fingerprints of blocks: where the radix tree looks a block up, not what it is.

fingerprint(block) = C * fingerprint(previous block) + mix(sum_k token_k * R_k + num_tokens * R_len)
(mod 2**64), the root's from its reuse scope. A prompt's full blocks are fingerprinted with a few
array operations, not a hash call a block: the chain unrolls to a cumulative sum,
g_i = C**(i+1) * g_root + C**i * sum_{j<=i} C**-j * f_j, with C odd (so invertible mod 2**64).

A fingerprint only says where to look. Two blocks are the same block when their tokens are equal
and their parents are the same node (the radix tree checks both), so equal fingerprints of
different blocks cost a slower lookup, never a wrong match: the cache is exact, not probably right.
"""

from __future__ import annotations

from array import array
from typing import Sequence

import numpy as np

from kvtool.manager.block_keys import ReuseScope, root_key, token_array

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = 0x9E3779B97F4A7C15
_C = 0xD6E8FEB86659FD93
"""The chain's multiplier (odd)."""
_C_INVERSE = pow(_C, -1, 1 << 64)
_MASK = (1 << 64) - 1


_30, _27, _31 = np.uint64(30), np.uint64(27), np.uint64(31)

# Array arithmetic on uint64 wraps silently (only scalar arithmetic warns): no errstate needed.


def mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, element-wise on a uint64 array (wrapping); changes `z` in place."""
    z ^= z >> _30
    z *= _M1
    z ^= z >> _27
    z *= _M2
    z ^= z >> _31
    return z


def _weights(count: int) -> np.ndarray:
    """R_0 .. R_{count-1}: odd pseudo-random uint64 constants, the same in every process."""
    return mix(np.arange(1, count + 1, dtype=np.uint64) * np.uint64(_GOLDEN)) | np.uint64(1)


class Fingerprinter:
    """Fingerprints of blocks of `tokens_per_block` tokens (and partial blocks of fewer)."""

    def __init__(self, tokens_per_block: int) -> None:
        self.tokens_per_block = tokens_per_block
        weights = _weights(tokens_per_block + 1)
        self._weights, self._length_weight = weights[:tokens_per_block], int(weights[tokens_per_block])
        self._full_length_term = np.uint64((tokens_per_block * self._length_weight) & _MASK)
        self._powers = np.ones(1, dtype=np.uint64)
        self._inverse_powers = np.ones(1, dtype=np.uint64)

    def full_blocks(self, previous: int, tokens: np.ndarray) -> np.ndarray:
        """The chained fingerprints (uint64) of the full blocks of `tokens` (uint32; a trailing
        partial block is ignored), the first chained after the block fingerprinted `previous`."""
        tpb = self.tokens_per_block
        count = len(tokens) // tpb
        if not count:
            return np.zeros(0, dtype=np.uint64)
        own = tokens[:count * tpb].reshape(count, tpb).astype(np.uint64) @ self._weights
        own += self._full_length_term
        return self._chain(previous, mix(own))

    def block(self, previous: int, tokens: Sequence[int]) -> int:
        """The fingerprint of one block of 1 .. tokens_per_block tokens after `previous`."""
        values = np.asarray(tokens, dtype=np.uint64)
        linear = int((values * self._weights[:len(values)]).sum()) + len(values) * self._length_weight
        own = int(mix(np.array([linear & _MASK], dtype=np.uint64))[0])
        return (_C * previous + own) & _MASK

    def one_step(self, previous: np.ndarray, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Fingerprints of unrelated blocks (rows of `tokens`, the first `lengths[i]` of row i
        counting) each after its own `previous` (uint64 arrays)."""
        width = np.arange(self.tokens_per_block)
        values = np.where(width < lengths[:, None], tokens, 0).astype(np.uint64)
        own = mix(values @ self._weights + lengths.astype(np.uint64) * np.uint64(self._length_weight))
        return np.uint64(_C) * previous + own

    def _chain(self, previous: int, own: np.ndarray) -> np.ndarray:
        count = len(own)
        if len(self._powers) <= count:
            self._grow_powers(count + 1)
        own *= self._inverse_powers[:count]
        sums = own.cumsum()
        sums *= self._powers[:count]
        sums += self._powers[1:count + 1] * np.uint64(previous)
        return sums

    def _grow_powers(self, count: int) -> None:
        if len(self._powers) >= count:
            return
        size = max(count, 2 * len(self._powers), 4096)
        powers = np.cumprod(np.full(size, _C, dtype=np.uint64), dtype=np.uint64)
        self._powers = np.concatenate((np.ones(1, dtype=np.uint64), powers[:-1]))
        inverse = np.cumprod(np.full(size, _C_INVERSE, dtype=np.uint64), dtype=np.uint64)
        self._inverse_powers = np.concatenate((np.ones(1, dtype=np.uint64), inverse[:-1]))


def uint32_tokens(tokens: Sequence[int]) -> np.ndarray:
    """The tokens as a uint32 array (a view of an `array` of 4-byte ints, no copy: do not let it
    outlive a change to that array); ValueError for ids outside [0, 2**32)."""
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.uint32:
        return tokens
    if isinstance(tokens, array) and tokens.itemsize == 4 and tokens.typecode in "IL":
        return np.frombuffer(tokens, dtype=np.uint32)
    return np.frombuffer(token_array(tokens), dtype=np.uint32)


def scope_fingerprint(scope: ReuseScope) -> int:
    """The root fingerprint of a reuse scope (the first 8 bytes of its SHA-256 root key)."""
    return int.from_bytes(root_key(scope)[:8], "little")
