"""How a stored block describes itself: a header (magic, layer group, block key, payload size, the
payload's SHA-256) before the page bytes, so that a reader can prove a value is the block it asked
for, whole and unchanged. Shared by every store that keeps blocks outside kvtool's memory (files,
remote servers); a value that does not check out is a miss, never bytes in a page.
"""

from __future__ import annotations

import hashlib
import struct

from kvtool.connector.llm_args import LlmArgs

MAGIC = b"KVTOOLB1"
HEADER = struct.Struct("<8sI32sQ32s")   # magic, layer group, block key, payload bytes, payload sha256


class CorruptBlock(Exception):
    """A stored value that does not hold what its key promises."""


def encode_block(key: bytes, layer_group_id: int, payload: bytes) -> bytes:
    """The header and the payload, as stored."""
    return HEADER.pack(MAGIC, layer_group_id, key, len(payload), hashlib.sha256(payload).digest()) + payload


def decode_block(data: bytes, key: bytes, layer_group_id: int, payload_bytes: int, where: str) -> memoryview:
    """The payload of a stored value, verified against the block it should be; CorruptBlock (its
    message starting with `where`) for anything that does not check out."""
    if len(data) < HEADER.size:
        raise CorruptBlock(f"{where}: truncated header ({len(data)} bytes)")
    magic, group, stored_key, size, digest = HEADER.unpack_from(data)
    payload = memoryview(data)[HEADER.size:]
    if magic != MAGIC or group != layer_group_id or stored_key != key:
        raise CorruptBlock(f"{where}: header does not describe this block")
    if size != payload_bytes:
        raise CorruptBlock(f"{where}: header records a {size}-byte payload; this layout's pages hold {payload_bytes}")
    if len(payload) != size:
        raise CorruptBlock(f"{where}: value holds {len(payload)} payload bytes; its header records {size}")
    if hashlib.sha256(payload).digest() != digest:
        raise CorruptBlock(f"{where}: checksum mismatch")
    return payload


def layout_signature(model_name: str, llm_args: LlmArgs) -> str:
    """16 hex digits naming what a stored block's bytes mean: the model, dtype, tokens per block
    and every layer group's layers, window, sinks and page size. Two layouts that differ in any of
    these never share a stored block."""
    parts = [model_name, llm_args.dtype, str(llm_args.kv_cache_config.tokens_per_block)]
    parts += [f"{g.layer_group_id}:{g.layer_ids}:{g.window_size}:{g.num_sink_tokens}:{g.bytes_per_page}"
              for g in llm_args.layer_groups]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
