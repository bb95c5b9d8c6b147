"""Connectors written for one TensorRT-LLM runtime: each is correct there and relies on a behaviour
another runtime does not have, the way connectors ported between runtimes break. All start from
kvtool's host connector and change one thing."""

from __future__ import annotations

from dataclasses import replace

from kvtool.connectors.host import (
    HostConnectorScheduler,
    HostConnectorWorker,
    ReservingHostScheduler,
    ReservingHostWorker,
)


class Worker(HostConnectorWorker):
    """The host worker, for the schedulers below."""


class FirstChunkPagesOnly(HostConnectorScheduler):
    """Written for V1, which hands a request's whole prompt of pages to `update_state_after_alloc`
    and reports none for later chunks: it reads pages there only (decode blocks from the reports),
    and indexes them without a bound. Under V2 a later chunk's blocks have no page in its list."""

    def _observe(self, data, is_new, meta):
        tracker = self._trackers.get(data.request_id)
        if tracker is not None and not is_new and data.computed_position < len(tracker.tokens) - len(data.new_tokens):
            data = replace(data, new_block_ids=[], new_block_ids_by_layer_group=[])   # a prompt chunk: pages known
        super()._observe(data, is_new, meta)

    def _save_blocks(self, tracker, ordinals):
        for j in ordinals:
            for _, pages in tracker.pages.items():
                pages[j]   # noqa: B018 - V1 gave every prompt block's page at the first chunk
        return super()._save_blocks(tracker, ordinals)


class AskedOnce(HostConnectorScheduler):
    """Written for V1, where GUARANTEED_NO_EVICT never destroys an allocation: a second ask about a
    request is a bug to it. V2 asks a paused request again (once per allocation)."""

    def __init__(self, llm_args) -> None:
        super().__init__(llm_args)
        self._asked: set[int] = set()

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.request_id in self._asked:
            raise RuntimeError(f"asked twice about request {request.request_id}")
        self._asked.add(request.request_id)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)


class NeverReleases(ReservingHostScheduler):
    """Takes part in prefix reservations but ignores their release: the source entries it pinned for
    a promise stay pinned for good. Only `main`'s V2 reserves."""

    def release_prefix_reservation(self, request, reservation_id, start, end):
        pass


class ReservingWorker(ReservingHostWorker):
    pass
