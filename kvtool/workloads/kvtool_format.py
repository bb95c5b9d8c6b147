"""kvtool's own workload format: JSON Lines, one request a line with its token ids (schema in
workloads/README.md)."""

from __future__ import annotations

import math
from typing import Any

from kvtool.connector.request import Request
from kvtool.errors import InputError

_FIELDS = {"request_id", "prompt", "max_new_tokens", "arrival", "cache_salt", "generation_only"}


def parse_kvtool_record(raw: dict[str, Any]) -> Request:
    """The request of one decoded line; InputError saying what is wrong (the caller names the line)."""
    unknown = set(raw) - _FIELDS
    if unknown:
        raise InputError(f"unknown field(s) {', '.join(sorted(unknown))}")
    for key in ("request_id", "prompt", "max_new_tokens"):
        if key not in raw:
            raise InputError(f"missing field {key!r}")
    return Request(_int(raw, "request_id", 0), _prompt(raw["prompt"]), _int(raw, "max_new_tokens", 0),
                   cache_salt=_salt(raw.get("cache_salt")), is_generation_only=_bool(raw, "generation_only"),
                   arrival=_arrival(raw.get("arrival", 0.0)))


def _int(raw: dict[str, Any], key: str, minimum: int) -> int:
    value = raw[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InputError(f"{key} must be an integer >= {minimum}, got {value!r}")
    return value


def _prompt(value: Any) -> list[int]:
    if not isinstance(value, list) or not value:
        raise InputError("prompt must be a non-empty list of token ids")
    for token in value:
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < 2**32:
            raise InputError(f"prompt holds {token!r}: token ids are integers in [0, 2**32)")
    return value


def _salt(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise InputError(f"cache_salt must be a string, got {value!r}")
    return value


def _bool(raw: dict[str, Any], key: str) -> bool:
    value = raw.get(key, False)
    if not isinstance(value, bool):
        raise InputError(f"{key} must be true or false, got {value!r}")
    return value


def _arrival(value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise InputError(f"arrival must be a finite number of seconds >= 0, got {value!r}")
    return float(value)
