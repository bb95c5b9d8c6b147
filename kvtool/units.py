"""Parsing and printing of byte sizes (`8GiB`, `512MB`, `4096`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

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


SI_UNITS = frozenset({"k", "kb", "m", "mb", "g", "gb", "t", "tb"})
"""Units of powers of ten: `10GB` is 10**10 bytes, 9.31 GiB (said once where a capacity is typed)."""


def parse_token_count(text: str) -> int:
    """A positive number of tokens, written `1000000`, `1e6` or `1_000_000`; ValueError otherwise."""
    try:
        value = float(str(text).replace("_", ""))
    except ValueError:
        raise ValueError(f"not a number of tokens: {text!r}") from None
    if not value >= 1 or value != value or value == float("inf") or value != int(value):
        raise ValueError(f"a capacity in tokens must be a whole number >= 1, got {text!r}")
    return int(value)


@dataclass(frozen=True)
class Capacity:
    """A tier's size as a user typed it: a count of tokens (`1e6`) or bytes (`64GiB`); exactly one
    of `tokens` and `num_bytes` is set."""

    text: str
    tokens: int | None = None
    num_bytes: int | None = None

    def blocks(self, bytes_per_block: int, tokens_per_block: int) -> int:
        """Whole blocks it holds (at least one): tokens // tokens per block, or bytes // the bytes
        of one block (the rank's shard, every layer group)."""
        if self.tokens is not None:
            return max(self.tokens // tokens_per_block, 1)
        assert self.num_bytes is not None, "a capacity is tokens or bytes"
        return max(self.num_bytes // bytes_per_block, 1)

    @property
    def si_note(self) -> str | None:
        """`10GB is SI: 10,000,000,000 bytes = 9.31 GiB` for a size in powers of ten, else None."""
        unit = _SIZE.match(self.text)
        if self.num_bytes is None or unit is None or unit.group(2).lower() not in SI_UNITS:
            return None
        return f"{self.text.strip()} is SI: {self.num_bytes:,} bytes = {self.num_bytes / 2**30:.2f} GiB"


def parse_capacity(text: str) -> Capacity:
    """`1e6` or `1000000` (tokens) or `64GiB` / `10GB` / `512MiB` (bytes); ValueError naming both
    forms otherwise."""
    stripped = str(text).strip()
    if not stripped[-1:].isalpha():                    # no unit: a count of tokens
        return Capacity(stripped, tokens=parse_token_count(stripped))
    try:
        return Capacity(stripped, num_bytes=parse_size(stripped))
    except InputError:
        raise ValueError(f"not a capacity: {text!r}: give tokens (1e6) or a size (64GiB, 10GB)") from None


def format_gib(num_bytes: float) -> str:
    """`64 GiB`, `1.5 GiB`, `0.25 GiB`: bytes in GiB, up to two decimals and no trailing zeros;
    below 0.01 GiB in MiB or KiB (`format_size`)."""
    if num_bytes < 0.01 * 2**30:
        return format_size(num_bytes)
    return f"{num_bytes / 2**30:.2f}".rstrip("0").rstrip(".") + " GiB"
