"""Request workloads: JSON Lines, one request a line (schema in workloads/README.md)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kvtool.connector.request import Request
from kvtool.errors import InputError

_FIELDS = {"request_id", "prompt", "max_new_tokens", "arrival", "cache_salt", "generation_only"}


def load_workload(path: Path) -> list[Request]:
    """Requests of a workload file; InputError naming the file and line for anything malformed."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise InputError(f"cannot read workload {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise InputError(f"workload {path} is not UTF-8 text") from None
    requests, seen = [], set()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            request = parse_request(line)
        except InputError as exc:
            raise InputError(f"{where}: {exc}") from None
        if request.request_id in seen:
            raise InputError(f"{where}: request_id {request.request_id} appears twice")
        seen.add(request.request_id)
        requests.append(request)
    if not requests:
        raise InputError(f"workload {path} has no requests")
    return requests


def parse_request(line: str) -> Request:
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InputError(f"not valid JSON ({exc.msg})") from None
    except RecursionError:
        raise InputError("JSON nested too deeply") from None
    if not isinstance(raw, dict):
        raise InputError("each line must be a JSON object")
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
