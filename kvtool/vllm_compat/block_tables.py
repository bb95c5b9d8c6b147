"""The worker's block tables, kept from `SchedulerOutput` alone, as vLLM 0.32.0's GPU model runner
keeps them (`GPUModelRunner._update_states`): finished and preempted requests dropped; a new
request's `block_ids` taken whole; a running request's `new_block_ids` appended, or taken whole
when its id is in `resumed_req_ids` (a preempted request scheduled again).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Scheduled:
    """One request's share of a step: compute positions [start, end) into its blocks per group."""

    request_id: str
    start: int
    end: int
    blocks: tuple[tuple[int, ...], ...]
    """Block ids per KV cache group (position = group index)."""


class BlockTables:
    """Block ids per request per KV cache group, as the worker knows them."""

    def __init__(self) -> None:
        self._tables: dict[str, list[list[int]]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tables

    def blocks(self, request_id: str) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(group) for group in self._tables[request_id])

    def update(self, output: Any) -> list[Scheduled]:
        """Apply one `SchedulerOutput`; the step's scheduled requests, new ones first, as the
        runner's batch orders them."""
        self._drop(output)
        starts: dict[str, int] = {}
        for new in output.scheduled_new_reqs:
            self._tables[new.req_id] = [list(group) for group in new.block_ids]
            starts[new.req_id] = new.num_computed_tokens
        cached = output.scheduled_cached_reqs
        for i, request_id in enumerate(cached.req_ids):
            self._apply_cached(request_id, cached.new_block_ids[i], request_id in cached.resumed_req_ids)
            starts[request_id] = cached.num_computed_tokens[i]
        return [Scheduled(rid, starts[rid], starts[rid] + n, self.blocks(rid))
                for rid, n in output.num_scheduled_tokens.items()]

    def _drop(self, output: Any) -> None:
        for request_id in set(output.finished_req_ids) | set(output.preempted_req_ids or ()):
            self._tables.pop(request_id, None)

    def _apply_cached(self, request_id: str, new_block_ids: Any, resumed: bool) -> None:
        if resumed:
            self._tables[request_id] = [list(group) for group in new_block_ids]
        elif new_block_ids is not None:
            for group, ids in zip(self._tables[request_id], new_block_ids, strict=True):
                group.extend(ids)
