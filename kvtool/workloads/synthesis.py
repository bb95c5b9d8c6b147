"""Token ids synthesized from a trace's block ids.

A published trace names each block of a prompt by an id that stands for the block *and every
block before it*; it carries no text. A block's tokens here are a pure function of its id (a
splitmix64 stream over `id * block_size + offset`, 32-bit tokens), so equal ids give equal
tokens and different ids different ones (two ids share a token with chance 2**-32). The
manager's chained SHA-256 keys then see exactly the reuse the trace encodes, whatever
`tokens_per_block` replays it: a replay block that straddles two source blocks is reused exactly
when the later one's id (hence both) matches.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_30, _27, _31, _32 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(32)
_STEPS: dict[int, np.ndarray] = {}
"""(offset + 1) * golden for each offset in a block, by block size."""


def synthesize_tokens(hash_ids: Sequence[int] | np.ndarray, input_length: int, block_size: int) -> np.ndarray:
    """The `input_length` tokens (uint32) of a prompt whose i-th block of `block_size` tokens has id
    `hash_ids[i]`; the last block may be partial (its tokens are the first ones of the full block).
    Needs `len(hash_ids) == ceil(input_length / block_size)`.

    Token (i, k) is the high half of splitmix64(hash_ids[i] * block_size + k). Its first step,
    z = x * golden + golden, is written base(id) + (k + 1) * golden so a block is one broadcast
    add; the rest works in place (array arithmetic on uint64 wraps silently)."""
    steps = _STEPS.get(block_size)
    if steps is None:
        steps = _STEPS[block_size] = np.arange(1, block_size + 1, dtype=np.uint64) * _GOLDEN
    base = np.asarray(hash_ids, dtype=np.uint64) * np.uint64(block_size)
    base *= _GOLDEN
    z = (base[:, None] + steps[None, :]).reshape(-1)[:input_length]
    scratch = z >> _30
    z ^= scratch
    z *= _MIX1
    np.right_shift(z, _27, out=scratch)
    z ^= scratch
    z *= _MIX2
    # The last step's high half, (z ^ (z >> 31)) >> 32, is high ^ (high >> 31) with high = z >> 32:
    # worked on the 4-byte high halves in place of the 8-byte words.
    high = z.view(np.uint32)[1::2] if sys.byteorder == "little" else (z >> _32).astype(np.uint32)
    return high ^ (high >> np.uint32(31))
