"""Chained block keys: every way of computing them gives the chain key(n) = SHA-256(key(n-1) || tokens)."""

from __future__ import annotations

import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.manager.block_keys import (
    _PACK_WINDOW_BLOCKS,
    ReuseScope,
    block_key,
    chain_keys,
    chained_block_keys,
    root_key,
    tokens_bytes,
)


def reference_chain(tokens, tokens_per_block, scope, include_partial):
    previous, out = root_key(scope), []
    end = len(tokens) if include_partial else len(tokens) - len(tokens) % tokens_per_block
    for start in range(0, end, tokens_per_block):
        block = tokens[start:start + tokens_per_block]
        packed = b"".join(t.to_bytes(4, "little") for t in block)
        previous = hashlib.sha256(previous + packed).digest()
        out.append((block, previous))
    return out


@settings(max_examples=60, deadline=None)
@given(tokens_per_block=st.sampled_from([1, 4, 7, 32]), include_partial=st.booleans(),
       salt=st.sampled_from([None, 5]), data=st.data())
def test_chained_block_keys_across_pack_windows(tokens_per_block, include_partial, salt, data):
    """Prompts around the packing window's edges (one window, one block more, a partial tail)."""
    window = _PACK_WINDOW_BLOCKS * tokens_per_block
    length = data.draw(st.sampled_from([0, 1, tokens_per_block, window - 1, window, window + 1,
                                        2 * window + tokens_per_block + 3]))
    tokens = data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=length, max_size=length))
    scope = ReuseScope(None, salt)
    expected = reference_chain(tokens, tokens_per_block, scope, include_partial)
    assert list(chained_block_keys(tokens, tokens_per_block, scope, include_partial)) == expected
    full = len(tokens) // tokens_per_block
    assert chain_keys(root_key(scope), tokens_bytes(tokens), tokens_per_block) == [k for _, k in expected[:full]]
    if expected:
        assert block_key(root_key(scope), tokens[:tokens_per_block]) == expected[0][1]
