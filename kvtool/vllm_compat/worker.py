"""One vLLM worker, played by kvtool: the connector's worker side built by vLLM's factory, the KV
cache tensors allocated by vLLM's `allocate_kv_cache` and registered as the model runner registers
them, and each step's hooks in the order of vLLM 0.32.0's V1 model runner:

1. `handle_preemptions(metadata)` (`GPUModelRunner.execute_model`, before the batch is updated);
2. the step's `kv_cache_block_copies` applied (`_update_states`);
3. `KVConnectorModelRunnerMixin._get_kv_connector_output`: `bind_connector_metadata`; when
   `has_sync_kv_loads`, `start_load_kv(forward_context)` before the forward, else after it; the
   forward, per attention layer (`maybe_transfer_kv_layer`): the step's keys and values written,
   `wait_for_layer_load(name)`, attention, `save_kv_layer(name, kv_cache, attn_metadata)`; then
   `wait_for_save`, `get_transfer_results(finished_req_ids)`, `get_block_ids_with_load_errors`,
   `get_kv_connector_stats`, `get_kv_connector_kv_cache_events`, `build_connector_worker_meta`,
   `clear_connector_metadata`. A step with no tokens scheduled runs the same with no forward and
   `attn_metadata` None (`kv_connector_no_forward`).

The forward is kvtool's fake one: fingerprints written for the positions computed, and every
position attention reads checked (`fingerprints.FingerprintPages`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtool.vllm_compat.block_tables import Scheduled
from kvtool.vllm_compat.engine_setup import BuiltEngine
from kvtool.vllm_compat.fingerprints import ByteIssue, FingerprintPages, layer_geometry
from kvtool.vllm_compat.hook_log import HookLog
from kvtool.vllm_compat.worker_rank import set_current_worker


@dataclass
class AttentionMetadata:
    """What `attn_metadata[layer_name]` is in the forward context: vLLM's attention backends'
    metadata carries the step's slot mapping (block id * block size + row, per scheduled token)."""

    slot_mapping: Any = None


@dataclass
class StepResult:
    """What one worker's step gives back: its connector output and what its reads found."""

    output: Any
    wrong: Counter[str] = field(default_factory=Counter)
    """Reads that differ, per request."""
    issues: list[ByteIssue] = field(default_factory=list)


class VllmWorker:
    """Worker `rank` of a built engine: its connector, its tensors, its pages."""

    def __init__(self, built: BuiltEngine, rank: int, hooks: HookLog) -> None:
        import torch
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.worker.utils import allocate_kv_cache

        self.rank = rank
        self._built = built
        self._hooks = hooks
        kv_config = built.worker_kv_configs[rank]
        layout = KVCacheLayout[built.vllm_config.cache_config.kv_cache_layout]
        self.tensors = allocate_kv_cache(kv_config, torch.device("cpu"), layout)
        self.pages = FingerprintPages(self.tensors, layer_geometry(built.worker_models[rank].spec),
                                      built.shape.block_size, rank)
        self.pages.poison(range(kv_config.num_blocks))
        self._layers = {name: _Layer(tensor) for name, tensor in self.tensors.items()}
        set_current_worker(rank)
        self.connector = KVConnectorFactory.create_connector(built.vllm_config, KVConnectorRole.WORKER, kv_config)
        self._register()

    def _register(self) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import copy_kv_blocks

        self.activate()
        self._call("register_kv_caches", self.tensors)
        self._call("set_host_xfer_buffer_ops", copy_kv_blocks)

    def activate(self) -> None:
        """Make this worker the one vLLM's globals name: the KV transfer group (what
        `ensure_kv_transfer_initialized` sets) and the forward context's attention layers."""
        from vllm.distributed.kv_transfer import kv_transfer_state

        kv_transfer_state._KV_CONNECTOR_AGENT = self.connector
        set_current_worker(self.rank)
        self._built.vllm_config.compilation_config.static_forward_context.update(self._layers)

    def step(self, output: Any, scheduled: list[Scheduled], hashes: Mapping[str, np.ndarray]) -> StepResult:
        """One step of this worker for `output` (a `SchedulerOutput`)."""
        from vllm.forward_context import set_forward_context
        from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace

        self.activate()
        self._call("handle_preemptions", output.kv_connector_metadata)
        if output.kv_cache_block_copies:
            copy_kv_cache_blocks_inplace(self.tensors.values(), self._built.worker_kv_configs[self.rank].num_blocks,
                                         output.kv_cache_block_copies)
        result = StepResult(None)
        if not output.total_num_scheduled_tokens:
            with set_forward_context(None, self._built.vllm_config):
                result.output = self._connector_output(output, lambda: None)
            return result
        metadata = {name: AttentionMetadata(_slot_mapping(scheduled, self._built, name)) for name in self._layers}
        with set_forward_context(metadata, self._built.vllm_config):
            result.output = self._connector_output(output, lambda: self._forward(scheduled, hashes, metadata, result))
        return result

    def _connector_output(self, output: Any, forward: Callable[[], None]) -> Any:
        """`KVConnectorModelRunnerMixin._get_kv_connector_output` around `forward`, call by call."""
        from vllm.forward_context import get_forward_context
        from vllm.v1.outputs import KVConnectorOutput

        result = KVConnectorOutput()
        self._call("bind_connector_metadata", output.kv_connector_metadata)
        if output.has_sync_kv_loads:
            self._call("start_load_kv", get_forward_context())
        forward()
        if not output.has_sync_kv_loads:
            self._call("start_load_kv", get_forward_context())
        self._call("wait_for_save")
        transfers = self._call("get_transfer_results", output.finished_req_ids)
        result.finished_sending = transfers.finished_sending
        result.finished_recving = transfers.finished_recving
        result.failed_recving = transfers.failed_recving
        result.invalid_block_ids = self._call("get_block_ids_with_load_errors")
        result.kv_connector_stats = self._call("get_kv_connector_stats")
        result.kv_cache_events = self._call("get_kv_connector_kv_cache_events")
        result.kv_connector_worker_meta = self._call("build_connector_worker_meta")
        self._call("clear_connector_metadata")
        return result

    def _forward(self, scheduled: list[Scheduled], hashes: Mapping[str, np.ndarray],
                 metadata: Mapping[str, AttentionMetadata], result: StepResult) -> None:
        for name, layer in self._layers.items():
            group = self._built.group_of_layer[name]
            for s in scheduled:
                self.pages.write(name, s.blocks[group], hashes[s.request_id], s.start, s.end)
            self._call("wait_for_layer_load", name)
            for s in scheduled:
                self._check(result, s, name, hashes[s.request_id], attended(s.start, s.end, self.window(name)))
            self._call("save_kv_layer", name, layer.kv_cache, metadata[name])

    def check_live(self, request_id: str, blocks: tuple[tuple[int, ...], ...], hashes: np.ndarray,
                   num_computed: int, pending: frozenset[int] = frozenset()) -> StepResult:
        """Every position the request's next step attends to, in every layer (after a step), but
        those in `pending` blocks (reported failed this step: vLLM has them recomputed before a
        sharer reads them, which the forward's own reads check)."""
        result = StepResult(None)
        scheduled = Scheduled(request_id, num_computed, num_computed, blocks)
        size = self._built.shape.block_size
        for name in self._layers:
            group = blocks[self._built.group_of_layer[name]]
            positions = [p for p in attended(num_computed, num_computed, self.window(name))
                         if group[p // size] not in pending]
            self._check(result, scheduled, name, hashes, positions)
        return result

    def window(self, name: str) -> int | None:
        return self._built.worker_models[self.rank].windows()[name]

    def _check(self, result: StepResult, s: Scheduled, name: str, hashes: np.ndarray,
               positions: range | list[int]) -> None:
        group = self._built.group_of_layer[name]
        num_wrong, issues = self.pages.check(s.request_id, name, s.blocks[group], hashes, list(positions))
        result.wrong[s.request_id] += num_wrong
        result.issues += issues

    def _call(self, hook: str, *args: Any) -> Any:
        return self._hooks.call(self.rank, self.connector, hook, *args)


def attended(start: int, end: int, window: int | None) -> range:
    """The positions a layer reads while computing [start, end) (at least the position `start`
    would read, for an empty range): all earlier ones, or a window's."""
    first = 0 if window is None else max(0, start - window + 1)
    return range(first, end)


class _Layer:
    """An attention layer as the forward context's `no_compile_layers` holds it: its `kv_cache`."""

    def __init__(self, kv_cache: Any) -> None:
        self.kv_cache = kv_cache


def _slot_mapping(scheduled: list[Scheduled], built: BuiltEngine, name: str) -> Any:
    import torch

    size = built.shape.block_size
    group = built.group_of_layer[name]
    slots = [s.blocks[group][p // size] * size + p % size for s in scheduled for p in range(s.start, s.end)]
    return torch.tensor(slots, dtype=torch.long)
