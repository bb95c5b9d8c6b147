"""A connector whose every hook call lands on a MagicMock, the way TensorRT-LLM's connector tests
patch MagicMock scheduler and worker objects into the executor.

kvtool constructs the connector classes itself (from a ConnectorSpec), so the classes here are thin
subclasses of the API's ABCs that forward each hook, with its arguments, to a mock the test
configures beforehand (`return_value`, `side_effect`) and inspects afterwards (`call_count`,
`call_args_list`). Scheduler and worker mocks are children of one parent mock, so
`parent.mock_calls` keeps the order of calls across both sides.

The grouped hooks are recorded, then fall through to the API's defaults, which hand a cache of one
layer group to the flat forms (recorded too): the same effect as the side effects TensorRT-LLM's
fixture puts on its grouped mocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from unittest.mock import MagicMock

from kvtool.connector.api import KvCacheConnectorScheduler, KvCacheConnectorWorker
from kvtool.connector.loader import ConnectorSpec


class _ForwardingScheduler(KvCacheConnectorScheduler):
    mock: MagicMock

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.mock.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, block_ids):
        self.mock.update_state_after_alloc(request, block_ids)

    def update_state_after_alloc_by_layer_group(self, request, block_ids_by_layer_group):
        self.mock.update_state_after_alloc_by_layer_group(request, block_ids_by_layer_group)
        super().update_state_after_alloc_by_layer_group(request, block_ids_by_layer_group)

    def build_connector_meta(self, scheduler_output):
        return self.mock.build_connector_meta(scheduler_output)

    def request_finished(self, request, cache_block_ids):
        return self.mock.request_finished(request, cache_block_ids)

    def request_finished_by_layer_group(self, request, cache_block_ids_by_layer_group):
        self.mock.request_finished_by_layer_group(request, cache_block_ids_by_layer_group)
        return super().request_finished_by_layer_group(request, cache_block_ids_by_layer_group)

    def cancel_load(self, request, start, end):
        self.mock.cancel_load(request, start, end)

    def request_reset(self, request):
        self.mock.request_reset(request)


class _ForwardingWorker(KvCacheConnectorWorker):
    mock: MagicMock

    def register_kv_cache_layout(self, layout):
        self.mock.register_kv_cache_layout(layout)   # no fall-through: TensorRT-LLM's mock keeps it too

    def register_kv_caches(self, kv_cache_tensor):
        self.mock.register_kv_caches(kv_cache_tensor)

    def start_load_kv(self, stream):
        self.mock.start_load_kv(stream)

    def wait_for_layer_load(self, layer_idx, stream):
        self.mock.wait_for_layer_load(layer_idx, stream)

    def save_kv_layer(self, layer_idx, stream):
        self.mock.save_kv_layer(layer_idx, stream)

    def wait_for_save(self, stream):
        self.mock.wait_for_save(stream)

    def get_finished(self, finished_gen_req_ids, started_loading_req_ids):
        return self.mock.get_finished(finished_gen_req_ids, started_loading_req_ids)


@dataclass
class MockConnector:
    spec: ConnectorSpec
    calls: MagicMock
    """Parent of both: `calls.mock_calls` is every hook call in order."""
    scheduler: MagicMock
    worker: MagicMock


def mock_connector(matched=(0, False), finish_async: bool = False, echo_finished: bool = False) -> MockConnector:
    """A spec whose scheduler answers `matched` and `finish_async`; its worker's `get_finished`
    answers `([], [])`, or echoes its inputs (every save and load done at the first poll)."""
    calls = MagicMock(name="connector")
    scheduler, worker = calls.scheduler, calls.worker
    scheduler.get_num_new_matched_tokens.return_value = matched
    scheduler.request_finished.return_value = finish_async
    scheduler.build_connector_meta.return_value = None
    if echo_finished:
        worker.get_finished.side_effect = lambda saving, loading: (saving, loading)
    else:
        worker.get_finished.return_value = ([], [])
    scheduler_class = type("MockScheduler", (_ForwardingScheduler,), {"mock": scheduler})
    worker_class = type("MockWorker", (_ForwardingWorker,), {"mock": worker})
    return MockConnector(ConnectorSpec("mock", scheduler_class, worker_class, __name__), calls, scheduler, worker)


# ---- reading the record ----------------------------------------------------------------------

def outputs(mc: MockConnector) -> list:
    """Every SchedulerOutput build_connector_meta received, in order."""
    return [c.args[0] for c in mc.scheduler.build_connector_meta.call_args_list]


def shape(out) -> tuple[int, int]:
    """(new requests, cached requests) of one SchedulerOutput."""
    return len(out.new_requests), len(out.cached_requests)


def first_args(hook) -> list:
    """The first argument of every call (a layer index, a request...)."""
    return [c.args[0] for c in hook.call_args_list]


def request_ids(hook) -> list[int]:
    """The ids of the requests a scheduler hook was called for, sorted (one entry per call)."""
    return sorted(request.request_id for request in first_args(hook))


def order(mc: MockConnector, *names: str) -> dict[str, list[int]]:
    """Positions in the whole call log of the calls to `names` (e.g. "worker.get_finished")."""
    return {name: [i for i, c in enumerate(mc.calls.mock_calls) if c[0] == name] for name in names}
