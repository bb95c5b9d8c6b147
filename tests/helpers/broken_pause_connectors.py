"""Connectors that mishandle a paused request (TensorRT-LLM's MAX_UTILIZATION pause), built on the
shipped example connector: each saves blocks from page indices of the allocation that was taken
back (another request's KV, or poison) under the paused request's keys; `pause-replay` catches it.

Targets:
- `tests/helpers/broken_pause_connectors.py:KeepsPagesAcrossPause:DictConnectorWorker`: the
  scheduler takes the early `request_finished` for nothing and keeps the old pages at the replay.
- `tests/helpers/broken_pause_connectors.py:NamesBlocksByOrdinal:PageTableWorker` (issue 25): the
  scheduler is right; the worker's own page table per request id takes only an id's first
  `new_requests` report and then walks `cached_requests`, so the replay's new block list is lost.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from dict_connector import DictConnectorScheduler, DictConnectorWorker, valid_page_slots  # noqa: E402

__all__ = ["DictConnectorWorker", "KeepsPagesAcrossPause", "NamesBlocksByOrdinal", "PageTableWorker"]


class KeepsPagesAcrossPause(DictConnectorScheduler):
    """Takes the early `request_finished` of a paused request for nothing to act on, then reads the
    replay's report (its tokens) but keeps the page indices it had before the pause."""

    def request_finished_by_layer_group(self, request, cache_block_ids_by_layer_group):
        if not request.is_finished:      # taken for an abort it need not act on: the request is kept
            return False
        return super().request_finished_by_layer_group(request, cache_block_ids_by_layer_group)

    def _completed(self, data, is_new):
        tracked = self._requests.get(data.request_id)
        if is_new and tracked is not None and tracked.pages:
            tracked.tokens = []
            return super()._completed(replace(data, new_block_ids_by_layer_group=[[] for _ in tracked.pages]), False)
        return super()._completed(data, is_new)


class NamesBlocksByOrdinal(DictConnectorScheduler):
    """The example's scheduler, whose own bookkeeping follows a pause (it forgets the request at the
    early `request_finished` and takes the replay's report whole), but it names each block it moves
    by (request id, block ordinal) and forwards every reported page list: `PageTableWorker`
    resolves the pages."""

    def update_state_after_alloc_by_layer_group(self, request, block_ids_by_layer_group):
        num_loads = len(self._loads)
        super().update_state_after_alloc_by_layer_group(request, block_ids_by_layer_group)
        self._loads[num_loads:] = [(key, group, (request.request_id, _ordinal(block_ids_by_layer_group[group], page)))
                                   for key, group, page in self._loads[num_loads:]]

    def _completed(self, data, is_new):
        saves = super()._completed(data, is_new)
        tracked = self._requests.get(data.request_id)
        return [(key, group, (rid, _ordinal(tracked.pages[group], page)), rid) for key, group, page, rid in saves]

    def build_connector_meta(self, scheduler_output):
        meta = super().build_connector_meta(scheduler_output)
        meta.reports = [(d.request_id, is_new, [list(pages) for pages in d.new_block_ids_by_layer_group])
                        for reported, is_new in ((scheduler_output.new_requests, True),
                                                 (scheduler_output.cached_requests, False)) for d in reported]
        return meta


class PageTableWorker(DictConnectorWorker):
    """Keeps its own table request id -> page lists: built from an id's first `new_requests` report,
    then extended from its `cached_requests` deltas; a later `new_requests` report of an id it knows
    is taken for a repeat and dropped. A paused request's replay is reported new, with a new block
    list, under the same id: the table keeps the pages of the allocation taken back (another
    request's now), and the replay's saves copy them under its keys."""

    def __init__(self, llm_args) -> None:
        super().__init__(llm_args)
        self._pages: dict[int, list[list[int]]] = {}

    def start_load_kv(self, stream):
        for rid, is_new, lists in self._metadata.reports:
            if rid not in self._pages:
                self._pages[rid] = [list(pages) for pages in lists]
            elif not is_new:                     # the defect: a known id's `new` report is dropped
                for table, delta in zip(self._pages[rid], lists, strict=True):
                    table += delta
        for key, group, block in self._metadata.loads:
            for region, saved in zip(self._regions[group], self._blocks[(key, group)], strict=True):
                region.slot_tensor(self._page(group, block)).copy_(saved)

    def wait_for_save(self, stream):
        stream.synchronize()
        for key, group, block in self._metadata.saves:
            page = self._page(group, block)
            self._blocks[(key, group)] = [r.slot_tensor(page).to("cpu", copy=True) for r in self._regions[group]]

    def _page(self, group: int, block: tuple[int, int]) -> int:
        rid, ordinal = block
        return self._pages[rid][group][ordinal]


def _ordinal(pages: list[int], page: int) -> int:
    """The block ordinal of `page` in one group's list."""
    return next(j for j, p in valid_page_slots(pages) if p == page)
