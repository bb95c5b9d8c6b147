"""Connectors for tests: a scripted scheduler that records every call, and an oracle worker that
"loads" exactly what a full recompute would have written (so protocol tests need no store)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvtool.connector.api import KvCacheConnectorScheduler, KvCacheConnectorWorker, SchedulerOutput
from kvtool.engine.pass_types import PassItem


@dataclass
class OracleLoad:
    request_id: int
    tokens: list[int]
    pages: list[list[int]]
    start: int
    end: int
    is_async: bool


@dataclass
class OracleMeta:
    loads: list[OracleLoad] = field(default_factory=list)


class ScriptedScheduler(KvCacheConnectorScheduler):
    """Answers `answer(request, num_computed)`; records every call in `calls`."""

    answer: Callable = staticmethod(lambda request, num_computed: (0, False))
    finish_async: bool = False

    def __init__(self, llm_args) -> None:
        super().__init__(llm_args)
        self.calls: list[tuple] = []
        self.outputs: list[SchedulerOutput] = []
        self._offers: dict[int, list[int]] = {}
        self._requests: dict[int, object] = {}
        self._pending: list[OracleLoad] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.calls.append(("ask", request.request_id, num_computed_tokens))
        answer = type(self).answer(request, num_computed_tokens)
        if isinstance(answer, tuple) and isinstance(answer[0], int) and answer[0] > 0:
            self._offers[request.request_id] = [num_computed_tokens, num_computed_tokens + answer[0], answer[1]]
        return answer

    def cancel_load(self, request, start, end):
        self.calls.append(("cancel", request.request_id, start, end))
        offer = self._offers.get(request.request_id)
        if offer:
            if start <= offer[0]:
                offer[0] = max(offer[0], end)
            else:
                offer[1] = min(offer[1], start)

    def update_state_after_alloc(self, request, block_ids):
        self.calls.append(("alloc_flat", request.request_id, list(block_ids)))

    def update_state_after_alloc_by_layer_group(self, request, block_ids_by_layer_group):
        self.calls.append(("alloc", request.request_id, [list(p) for p in block_ids_by_layer_group]))
        if len(block_ids_by_layer_group) == 1:   # as TensorRT-LLM's tests' mocks fold one group
            self.update_state_after_alloc(request, block_ids_by_layer_group[0])
        offer = self._offers.pop(request.request_id, None)
        if offer and offer[0] < offer[1]:
            self._pending.append(OracleLoad(request.request_id, request.get_tokens(), block_ids_by_layer_group,
                                            offer[0], offer[1], offer[2]))

    def build_connector_meta(self, scheduler_output):
        self.outputs.append(scheduler_output)
        meta, self._pending = OracleMeta(self._pending), []
        return meta

    def request_finished(self, request, cache_block_ids):
        self.calls.append(("finished_flat", request.request_id, list(cache_block_ids)))
        return type(self).finish_async

    def request_finished_by_layer_group(self, request, cache_block_ids_by_layer_group):
        self.calls.append(("finished", request.request_id,
                           [list(p) for p in cache_block_ids_by_layer_group]))
        if len(cache_block_ids_by_layer_group) == 1:
            return self.request_finished(request, cache_block_ids_by_layer_group[0])
        return type(self).finish_async

    def asks(self, request_id=None):
        return [c for c in self.calls if c[0] == "ask" and (request_id is None or c[1] == request_id)]

    def cancels(self):
        return [c[1:] for c in self.calls if c[0] == "cancel"]


class NoOpWorker(KvCacheConnectorWorker):
    """Every per-pass hook does nothing; subclasses override what they test."""

    def start_load_kv(self, stream):
        pass

    def wait_for_layer_load(self, layer_idx, stream):
        pass

    def save_kv_layer(self, layer_idx, stream):
        pass

    def wait_for_save(self, stream):
        pass

    def get_finished(self, finished_gen_req_ids, started_loading_req_ids):
        return [], []


class OracleWorker(NoOpWorker):
    """Writes the right fingerprints into the delivered pages; async loads land `delay` calls later."""

    delay: int = 2
    fake = None  # the engine's FakeEngine, set by the test after construction

    def __init__(self, llm_args) -> None:
        super().__init__(llm_args)
        self.layout = None
        self._async: dict[int, int] = {}
        self._given: set[int] = set()
        self._saves_given: set[int] = set()
        self.finished_calls: list[tuple] = []

    def register_kv_cache_layout(self, layout):
        self.layout = layout

    def register_kv_caches(self, kv_cache_tensor):
        """V1: the pool tensor (its loads go through the fake engine by page list all the same)."""
        self.tensor = kv_cache_tensor

    def start_load_kv(self, stream):
        for load in self._metadata.loads:
            self.fake.write_context(PassItem(load.request_id, load.tokens, load.pages, load.start, load.end, False))
            if load.is_async:
                self._async[load.request_id] = self.delay

    def get_finished(self, finished_gen_req_ids, started_loading_req_ids):
        self.finished_calls.append((list(finished_gen_req_ids), list(started_loading_req_ids)))
        self._given.update(started_loading_req_ids)
        self._saves_given.update(finished_gen_req_ids)
        loaded = []
        for rid in list(self._async):
            self._async[rid] -= 1
            if self._async[rid] <= 0 and rid in self._given:
                loaded.append(rid)
                del self._async[rid]
        saved, self._saves_given = sorted(self._saves_given), set()
        return saved, loaded
