"""Parsing and printing of byte sizes (`8GiB`, `512MB`, `4096`)."""

from __future__ import annotations

import re

from kvtool.errors import InputError

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes in `text`; InputError for anything that is not a positive size."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise InputError(f"cannot read size {text!r}: use a number with an optional unit such as 8GiB or 512MB")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise InputError(f"size {text!r} must be positive")
    return value


def format_size(num_bytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{int(num_bytes)} B"


def format_seconds(value: float | None) -> str:
    """Milliseconds below a second, seconds above; '-' for none (None or NaN)."""
    if value is None or value != value:
        return "-"
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"
