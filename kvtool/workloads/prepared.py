"""A workload read once into a token file and a request table, which several replays then stream
without parsing the trace again (a sweep's points, each in a process of its own).

Reading a Mooncake trace is parsing a JSON line and synthesizing its prompt from block ids, about
a tenth of a block-fidelity replay; a sweep of N points did it N times. The prepared copy holds
every prompt as 4-byte tokens in one file, memory-mapped by each reader, and what else a request
carries (id, output length, salt, arrival) in a JSON table. Its requests equal the source's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtool.connector.request import Request, progress_of
from kvtool.manager.block_keys import token_array, token_array_from_native
from kvtool.workloads.source import Workload

TOKENS_FILE = "tokens.u32"
TABLE_FILE = "requests.json"


@dataclass(frozen=True)
class PreparedWorkload(Workload):
    """`Workload` whose `requests()` come from `folder` (written by `prepare_workload`); sizes are
    still read from the source file."""

    folder: Path = Path()

    def requests(self) -> Iterator[Request]:
        table = json.loads((self.folder / TABLE_FILE).read_text())
        path = self.folder / TOKENS_FILE
        tokens = np.memmap(path, dtype=np.uint32, mode="r") if path.stat().st_size else np.zeros(0, np.uint32)
        for row in table:
            start, end = row["tokens"]
            prompt = token_array_from_native(np.ascontiguousarray(tokens[start:end]).data.cast("B"))
            yield Request(row["request_id"], prompt,
                          row["max_new_tokens"], row["cache_salt"], row["is_generation_only"],
                          arrival=row["arrival"])


def prepare_workload(workload: Workload, folder: Path) -> PreparedWorkload:
    """Read every request of `workload` (its InputErrors raised here, before any replay) into
    `folder`, and the workload that streams them from there."""
    table = []
    offset = 0
    with open(folder / TOKENS_FILE, "wb") as out:
        for request in workload.requests():
            prompt = token_array(progress_of(request).prompt_view())
            out.write(prompt.tobytes())
            table.append({"request_id": request.request_id, "tokens": [offset, offset + len(prompt)],
                          "max_new_tokens": request.max_new_tokens, "cache_salt": request.cache_salt,
                          "is_generation_only": request.is_generation_only_request, "arrival": request.arrival})
            offset += len(prompt)
    (folder / TABLE_FILE).write_text(json.dumps(table))
    return PreparedWorkload(workload.path, workload.format, workload.block_size, workload.prefill_only, folder)
