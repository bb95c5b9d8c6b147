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

from typing import Sequence

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x * _GOLDEN + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return z ^ (z >> np.uint64(31))


def synthesize_tokens(hash_ids: Sequence[int], input_length: int, block_size: int) -> np.ndarray:
    """The `input_length` tokens (uint32) of a prompt whose i-th block of `block_size` tokens has id
    `hash_ids[i]`; the last block may be partial (its tokens are the first ones of the full block).
    Needs `len(hash_ids) == ceil(input_length / block_size)`."""
    ids = np.asarray(hash_ids, dtype=np.uint64)
    offsets = np.arange(block_size, dtype=np.uint64)
    with np.errstate(over="ignore"):
        seeds = (ids[:, None] * np.uint64(block_size) + offsets[None, :]).reshape(-1)[:input_length]
    return (_splitmix64(seeds) >> np.uint64(32)).astype(np.uint32)
