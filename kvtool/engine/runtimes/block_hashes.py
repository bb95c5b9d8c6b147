"""`RequestData.block_hashes` as TensorRT-LLM's V1 reports them (#14806): one 64-bit hash per full
block of the request's tokens, each chained on its parent's, the cache salt mixed into the first.

The properties are V1's (one per full block, a chain, the salt in the first block only, the whole
chain so far on every report); the values are kvtool's own (the first 8 bytes of a SHA-256 over
the parent hash, the salt and the tokens), not those of TensorRT-LLM's C++ `BlockKeyHasher`, so a
connector must compare them with hashes of the same runtime only, as it must under TensorRT-LLM.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from kvtool.manager.block_keys import tokens_bytes


def block_hash(parent: int, tokens: Sequence[int], cache_salt: str | None) -> int:
    """The hash of one full block after a block hashed `parent` (0 for the first block, whose
    hash also takes the salt)."""
    digest = hashlib.sha256(parent.to_bytes(8, "little"))
    if parent == 0 and cache_salt is not None:
        digest.update(b"salt:" + cache_salt.encode("utf-8"))
    digest.update(tokens_bytes(tokens))
    return int.from_bytes(digest.digest()[:8], "little") or 1   # never 0: 0 means "no parent"


def extend_block_hashes(chain: list[int], tokens: Sequence[int], tokens_per_block: int,
                        cache_salt: str | None) -> list[int]:
    """`chain` (the hashes of the first full blocks of `tokens`, as computed before) extended in
    place to every full block of `tokens`; returned for convenience."""
    for j in range(len(chain), len(tokens) // tokens_per_block):
        parent = chain[-1] if chain else 0
        chain.append(block_hash(parent, tokens[j * tokens_per_block:(j + 1) * tokens_per_block], cache_salt))
    return chain
