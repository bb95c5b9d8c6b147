"""Connectors whose bugs depend on timing, for the tests that prove `kvtool validate` finds them
by construction (every run, every seed), not by luck.

- `EarlyReport:EarlyReportWorker`: host-async whose worker names a finished request's save in
  `get_finished` as soon as the id is given, before its background copies have landed.
- `ReplaysIntoOldPages:Worker`: keeps a request's first page lists by request id and plans the
  loads of a paused request's replay into them (the allocation the pause took back).
"""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

from kvtool.connectors.host import HostConnectorScheduler, HostConnectorWorker


def _async_args(llm_args):
    return replace(llm_args, connector_options={**llm_args.connector_options, "mode": "async"})


class EarlyReport(HostConnectorScheduler):
    """The host scheduler in async mode (request_finished answers True for a request with saves)."""

    def __init__(self, llm_args) -> None:
        super().__init__(_async_args(llm_args))


class EarlyReportWorker(HostConnectorWorker):
    """The defect: every finished id is reported at the first `get_finished` that names it; the
    background copy submitted in `wait_for_save` may still be reading the pages."""

    def __init__(self, llm_args) -> None:
        super().__init__(_async_args(llm_args))

    def get_finished(self, finished_gen_req_ids, started_loading_req_ids):
        _, loaded = super().get_finished([], started_loading_req_ids)
        return list(finished_gen_req_ids), loaded


class ReportsLanded(HostConnectorWorker):
    """The same worker without the defect: host-async as shipped (reports once the copies landed)."""

    def __init__(self, llm_args) -> None:
        super().__init__(_async_args(llm_args))


class WaitsInGetFinished(ReportsLanded):
    """Correct, and blocking: `get_finished` waits for the copies of every id it is given (the
    runtime's async gate must let the copy thread run while this hook waits)."""

    def get_finished(self, finished_gen_req_ids, started_loading_req_ids):
        for rid in finished_gen_req_ids:
            if rid in self._saving:
                self._saving[rid].result()
        return super().get_finished(finished_gen_req_ids, started_loading_req_ids)


class Worker(HostConnectorWorker):
    """The host worker (for schedulers that break only the scheduling side)."""


class ReplaysIntoOldPages(HostConnectorScheduler):
    """The defect: the page lists a request id was first given are kept, and a later allocation
    of the same id (a paused request's replay) is read through them: its loads are planned into
    the pages of the allocation the pause took back (another request's now, or free)."""

    def __init__(self, llm_args) -> None:
        super().__init__(llm_args)
        self._first_pages: dict[int, list[list[int]]] = {}

    def update_state_after_alloc_by_layer_group(self, request, block_ids_by_layer_group):
        first = self._first_pages.setdefault(request.request_id, [list(p) for p in block_ids_by_layer_group])
        kept = [old + list(new[len(old):]) for old, new in zip(first, block_ids_by_layer_group, strict=True)]
        super().update_state_after_alloc_by_layer_group(request, kept)


class RecordsAllocations(HostConnectorScheduler):
    """The host scheduler, recording every `update_state_after_alloc` (request id, page lists);
    `latest` is the one constructed last (a test reads it after the run)."""

    latest: ClassVar[RecordsAllocations | None] = None

    def __init__(self, llm_args) -> None:
        super().__init__(llm_args)
        self.allocations: list[tuple[int, list[list[int]]]] = []
        RecordsAllocations.latest = self

    def update_state_after_alloc_by_layer_group(self, request, block_ids_by_layer_group):
        self.allocations.append((request.request_id, [list(p) for p in block_ids_by_layer_group]))
        super().update_state_after_alloc_by_layer_group(request, block_ids_by_layer_group)


class ClaimsOneBlockMore(HostConnectorScheduler):
    """The defect: an off-by-one in the matched count. Where the index holds a prefix, one block
    past it is offered too; its load reads a store entry nobody wrote."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        num, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if num == 0:
            return num, is_async
        tpb = self.tokens_per_block
        extra = min(tpb, request.prompt_len - 1 - num_computed_tokens - num)
        tracker = self._trackers[request.request_id]
        if extra > 0 and tracker.planned:
            j = max(b for b, _ in tracker.planned) + 1
            for g in {g for _, g in tracker.planned}:
                tracker.planned[(j, g)] = tracker.planned[(j - 1, g)]   # the entry of the block before it
                self.pin(tracker.planned[(j, g)])
        return num + max(extra, 0), is_async


ENGINES_BUILT = [0]
"""Schedulers of `WrongFromTheSecondEngine` built in this process: module state, which outlives an engine."""


class WrongFromTheSecondEngine(ClaimsOneBlockMore):
    """Correct in the first engine of its process, off by one block from the second on: what a
    connector that keeps state in its module (a singleton cache, a counter) can do. Run alone at any
    seed, a one-engine scenario passes; after another seed's run in the same process it fails."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        ENGINES_BUILT[0] += 1
        self.wrong = ENGINES_BUILT[0] > 1

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if self.wrong:
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        return HostConnectorScheduler.get_num_new_matched_tokens(self, request, num_computed_tokens)
