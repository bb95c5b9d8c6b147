"""Chained SHA-256 block keys and the reuse scope that roots them.

key(block) = SHA-256(key(previous block) || the block's tokens as 4-byte little-endian ints);
the root key is SHA-256 of the reuse scope (LoRA id, salt derived from `cache_salt`). Matches
compare digests only, which is why the hash stays cryptographic and 256 bits wide.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np


class ReuseScope(NamedTuple):
    lora_id: int | None = None
    salt: int | None = None

    @staticmethod
    def from_cache_salt(cache_salt: str | None, lora_id: int | None = None) -> ReuseScope:
        """The scope of a request; requests with different salts never share a block."""
        if cache_salt is None:
            return ReuseScope(lora_id, None)
        digest = hashlib.sha256(cache_salt.encode("utf-8")).digest()
        return ReuseScope(lora_id, int.from_bytes(digest[:8], "little"))


def root_key(scope: ReuseScope) -> bytes:
    parts = [b"kvtool-reuse-scope"]
    for value in scope:
        parts.append(b"\x00" if value is None else b"\x01" + int(value).to_bytes(16, "little", signed=True))
    return hashlib.sha256(b"".join(parts)).digest()


_UINT32 = "I" if array("I").itemsize == 4 else "L"


def token_array(tokens: Sequence[int]) -> array:
    """The tokens as a compact `array` of 4-byte unsigned ints (4 bytes a token, not a Python int
    each); an array of that type is copied without converting. ValueError for ids outside [0, 2**32)."""
    try:
        return array(_UINT32, tokens)
    except (OverflowError, TypeError):
        raise ValueError("token ids must lie in [0, 2**32)") from None


def uint32_tokens(tokens: Sequence[int]) -> np.ndarray:
    """The tokens as a uint32 array (a view of an `array` of 4-byte ints, no copy: do not let it
    outlive a change to that array); ValueError for ids outside [0, 2**32)."""
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.uint32:
        return tokens
    if isinstance(tokens, array) and tokens.itemsize == 4 and tokens.typecode in "IL":
        return np.frombuffer(tokens, dtype=np.uint32)
    return np.frombuffer(token_array(tokens), dtype=np.uint32)


def token_array_from_native(buffer: bytes | memoryview) -> array:
    """`token_array` of tokens already packed as native-order 4-byte unsigned ints (a numpy
    uint32 array's bytes, or a byte view of it), without a Python int per token."""
    tokens = array(_UINT32)
    tokens.frombytes(buffer)
    return tokens


def tokens_bytes(tokens: Sequence[int]) -> bytes:
    """The tokens as 4-byte little-endian ints; ValueError for ids outside [0, 2**32)."""
    if isinstance(tokens, array) and tokens.typecode == _UINT32 and sys.byteorder == "little":
        return tokens.tobytes()
    try:
        packed = array(_UINT32, tokens)
    except (OverflowError, TypeError):
        raise ValueError("token ids must lie in [0, 2**32)") from None
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack_tokens(packed: bytes) -> tuple[int, ...]:
    """The tokens `tokens_bytes` packed."""
    unpacked = array(_UINT32)
    unpacked.frombytes(packed)
    if sys.byteorder == "big":
        unpacked.byteswap()
    return tuple(unpacked)


def block_key(previous: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.sha256(previous + tokens_bytes(tokens)).digest()


def chain_keys(previous: bytes, packed: bytes, tokens_per_block: int) -> list[bytes]:
    """Keys of consecutive full blocks after the block keyed `previous`, from their tokens packed
    by `tokens_bytes` (trailing bytes short of a block are ignored)."""
    sha256 = hashlib.sha256
    step = 4 * tokens_per_block
    keys = []
    for start in range(0, len(packed) - step + 1, step):
        previous = sha256(previous + packed[start:start + step]).digest()
        keys.append(previous)
    return keys


def chained_block_keys(tokens: Sequence[int], tokens_per_block: int, scope: ReuseScope,
                       include_partial: bool = False) -> Iterator[tuple[Sequence[int], bytes]]:
    """(block tokens, key) for each full block, then the trailing partial one if asked."""
    for i, key in enumerate(chained_keys(tokens, tokens_per_block, scope, include_partial)):
        yield tokens[i * tokens_per_block:(i + 1) * tokens_per_block], key


def chained_keys(tokens: Sequence[int], tokens_per_block: int, scope: ReuseScope,
                 include_partial: bool = False) -> Iterator[bytes]:
    """The key of each full block, then of the trailing partial one if asked; no block's tokens
    are sliced out (a match needs only keys).

    The tokens are packed a window of blocks at a time: a caller that stops at the first block
    it does not know (a match) packs little more than it hashes."""
    previous = root_key(scope)
    end = len(tokens) if include_partial else len(tokens) - len(tokens) % tokens_per_block
    sha256 = hashlib.sha256
    window, step = _PACK_WINDOW_BLOCKS * tokens_per_block, 4 * tokens_per_block
    for window_start in range(0, end, window):
        packed = tokens_bytes(tokens[window_start:min(window_start + window, end)])
        for start in range(0, len(packed), step):
            previous = sha256(previous + packed[start:start + step]).digest()
            yield previous


_PACK_WINDOW_BLOCKS = 64
