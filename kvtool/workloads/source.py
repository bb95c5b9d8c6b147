"""Opening a workload file of any supported format and streaming its requests.

The format is `kvtool` (token ids), `mooncake` or `bailian` (block ids), detected from the first
record's fields unless named. Requests are read one line at a time, so a trace of any length
replays in the memory of the requests in flight. Anything malformed is an InputError naming the
file and line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from kvtool.connector.request import Request
from kvtool.errors import InputError
from kvtool.workloads.imported import IMPORTED_FORMATS, parse_record
from kvtool.workloads.kvtool_format import parse_kvtool_record

FORMATS = ("kvtool", *IMPORTED_FORMATS)


@dataclass(frozen=True)
class RequestSize:
    """A request's lengths, as its workload line gives them (`Workload.request_sizes`)."""

    request_id: int
    line: int
    prompt_len: int
    max_new_tokens: int


@dataclass(frozen=True)
class Workload:
    """A workload file and how to read it. `requests()` may be called more than once."""

    path: Path
    format: str
    block_size: int | None = None
    """Tokens per id of an imported trace (None: the format's own)."""
    prefill_only: bool = False
    """Replace every request's output length by 0 (prefill, then finish)."""

    def requests(self) -> Iterator[Request]:
        seen: set[int] = set()
        for number, raw in _records(self.path):
            try:
                request = self._parse(raw, len(seen))
            except InputError as exc:
                raise InputError(f"{self.path} line {number}: {exc}") from None
            if request.request_id in seen:
                raise InputError(f"{self.path} line {number}: request_id {request.request_id} appears twice")
            seen.add(request.request_id)
            yield request
        if not seen:
            raise InputError(f"workload {self.path} has no requests")

    def request_sizes(self) -> Iterator[RequestSize]:
        """Each request's id and lengths, read from its line without building the request (an
        imported trace's tokens are not synthesized, a prompt's token ids only counted): a cheap
        pass over the file, to check sizes before a replay. A record too malformed to size is
        skipped; `requests()` names it when the replay reaches it."""
        imported = self.format != "kvtool"
        for index, (number, raw) in enumerate(_records(self.path)):
            prompt_len: object
            new: object
            request_id: object
            if imported:
                prompt_len, new, request_id = raw.get("input_length"), raw.get("output_length"), index
            else:
                prompt = raw.get("prompt")
                prompt_len = len(prompt) if isinstance(prompt, list) else None
                new, request_id = raw.get("max_new_tokens"), raw.get("request_id")
            if not (_is_count(prompt_len) and _is_count(new) and _is_count(request_id)):
                continue
            yield RequestSize(request_id, number, prompt_len, 0 if self.prefill_only else new)

    def count(self) -> int:
        """Requests in the file (its non-blank lines), without parsing them."""
        with _opened(self.path) as handle:
            return sum(1 for line in handle if line.strip())

    def _parse(self, raw: dict[str, Any], index: int) -> Request:
        if self.format != "kvtool":
            return parse_record(raw, index, IMPORTED_FORMATS[self.format], self.block_size, self.prefill_only)
        request = parse_kvtool_record(raw)
        if self.prefill_only and request.max_new_tokens:
            request = Request(request.request_id, request.prompt_token_ids, 0, request.cache_salt,
                              request.is_generation_only_request, arrival=request.arrival)
        return request


def open_workload(path: Path, format: str | None = None, block_size: int | None = None,
                  prefill_only: bool = False) -> Workload:
    """The workload at `path`; InputError for an unreadable file, an unknown format, or a first
    record whose format cannot be told."""
    if format is not None and format not in FORMATS:
        raise InputError(f"unknown workload format {format!r}; known: {', '.join(FORMATS)}")
    if block_size is not None and block_size <= 0:
        raise InputError(f"the source block size must be positive, got {block_size}")
    if format is None:
        format = detect_format(path)
    if block_size is not None and format == "kvtool":
        raise InputError("a source block size applies to traces of block ids (mooncake, bailian), "
                         "not to kvtool workloads")
    return Workload(path, format, block_size, prefill_only)


def detect_format(path: Path) -> str:
    """`kvtool` when the first record has `prompt`, `bailian` when it has `hash_ids` and `chat_id`,
    `mooncake` when it has `hash_ids`; InputError otherwise."""
    for number, raw in _records(path):
        if "prompt" in raw:
            return "kvtool"
        if "hash_ids" in raw:
            return "bailian" if "chat_id" in raw else "mooncake"
        raise InputError(f"{path} line {number}: cannot tell the workload format (no 'prompt' and no "
                         f"'hash_ids' field); name it with --format {'|'.join(FORMATS)}")
    raise InputError(f"workload {path} has no requests")


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, decoded object) of each non-blank line."""
    with _opened(path) as handle:
        number = 0
        while True:
            try:
                line = handle.readline()
            except UnicodeDecodeError:
                raise InputError(f"{path} line {number + 1}: not UTF-8 text") from None
            if not line:
                return
            number += 1
            if line.strip():
                yield number, _decode(line, f"{path} line {number}")


def _decode(line: str, where: str) -> dict[str, Any]:
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}: not valid JSON ({exc.msg})") from None
    except RecursionError:
        raise InputError(f"{where}: JSON nested too deeply") from None
    if not isinstance(raw, dict):
        raise InputError(f"{where}: each line must be a JSON object")
    return raw


def _opened(path: Path):
    try:
        return path.open(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"cannot read workload {path}: {exc.strerror or exc}") from None


def load_workload(path: Path, format: str | None = None) -> list[Request]:
    """Every request of a (small) workload, read at once."""
    return list(open_workload(path, format).requests())
