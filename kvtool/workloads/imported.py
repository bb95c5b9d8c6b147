"""Published trace formats: one JSON object a line, block ids instead of tokens.

- Mooncake (FAST'25 release): `timestamp` (ms), `input_length`, `output_length`, `hash_ids` (one
  id per 512-token block; the last block may be partial).
- Bailian / Qwen: `chat_id`, `parent_chat_id`, `timestamp` (s), `input_length`, `output_length`,
  `type`, `turn`, `hash_ids` (one id per 16-token block).

A record becomes a `Request` whose prompt is synthesized from its ids (`synthesis`); its id is
its position in the file (0, 1, ...), since neither format names requests uniquely.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtool.blocks import ceil_div
from kvtool.connector.request import Request
from kvtool.errors import InputError
from kvtool.manager.block_keys import token_array_from_native
from kvtool.workloads.synthesis import synthesize_tokens


@dataclass(frozen=True)
class TraceFormat:
    name: str
    block_size: int
    """Tokens behind one id."""
    seconds_per_tick: float
    """Unit of `timestamp`, in seconds."""
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()


_COMMON = ("timestamp", "input_length", "output_length", "hash_ids")
MOONCAKE = TraceFormat("mooncake", 512, 0.001, _COMMON)
BAILIAN = TraceFormat("bailian", 16, 1.0, _COMMON, ("chat_id", "parent_chat_id", "type", "turn"))
IMPORTED_FORMATS = {f.name: f for f in (MOONCAKE, BAILIAN)}


def parse_record(raw: dict[str, Any], index: int, fmt: TraceFormat, block_size: int | None = None,
                 prefill_only: bool = False) -> Request:
    """The request of one decoded line; InputError saying what is wrong (the caller names the line).
    `block_size` overrides the format's tokens per id; `prefill_only` makes every output length 0."""
    size = block_size or fmt.block_size
    unknown = set(raw) - set(fmt.required) - set(fmt.optional)
    if unknown:
        raise InputError(f"unknown field(s) {', '.join(sorted(unknown))} for the {fmt.name} format")
    missing = [key for key in fmt.required if key not in raw]
    if missing:
        raise InputError(f"missing field {missing[0]!r}")
    input_length = _count(raw, "input_length", 1)
    output_length = _count(raw, "output_length", 0)
    hash_ids = _block_ids(raw["hash_ids"])
    if len(hash_ids) != ceil_div(input_length, size):
        raise InputError(f"{len(hash_ids)} hash_ids for input_length {input_length}: "
                         f"{fmt.name} blocks of {size} tokens need {ceil_div(input_length, size)}")
    stamp = raw["timestamp"]
    if not isinstance(stamp, (int, float)) or isinstance(stamp, bool) or not math.isfinite(stamp) or stamp < 0:
        raise InputError(f"timestamp must be a finite number >= 0, got {stamp!r}")
    for key in ("chat_id", "parent_chat_id", "turn"):
        if key in raw and not _is_int(raw[key]):
            raise InputError(f"{key} must be an integer, got {raw[key]!r}")
    if "type" in raw and not isinstance(raw["type"], str):
        raise InputError(f"type must be a string, got {raw['type']!r}")
    tokens = token_array_from_native(synthesize_tokens(hash_ids, input_length, size).data.cast("B"))
    return Request(index, tokens, 0 if prefill_only else output_length, arrival=float(stamp) * fmt.seconds_per_tick)


def _block_ids(hash_ids: Any) -> np.ndarray:
    """The ids as int64; InputError unless a list of ints (not bools) in [0, 2**63)."""
    if not isinstance(hash_ids, list) or not set(map(type, hash_ids)) <= {int}:
        raise InputError("hash_ids must be a list of integers in [0, 2**63)")
    try:
        ids = np.array(hash_ids, dtype=np.int64)
    except OverflowError:
        raise InputError("hash_ids must be a list of integers in [0, 2**63)") from None
    if len(ids) and int(ids.min()) < 0:
        raise InputError("hash_ids must be a list of integers in [0, 2**63)")
    return ids


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(raw: dict[str, Any], key: str, minimum: int) -> int:
    value = raw[key]
    if not _is_int(value) or value < minimum:
        raise InputError(f"{key} must be an integer >= {minimum}, got {value!r}")
    return value
