"""How a rank's connector worker is built and given its KV cache: the runtime arguments of its
shard, the layout (or the single pool tensor for a worker that only takes one), and the stream its
hooks receive."""

from __future__ import annotations

import contextlib

import torch

from kvtool.connector.api import HostStream, KvCacheConnectorWorker
from kvtool.connector.llm_args import KvCacheConfig, KvCacheConnectorConfig, LayerGroupInfo, LlmArgs
from kvtool.connector.loader import ConnectorSpec
from kvtool.engine.runtimes.names import Registration
from kvtool.errors import ConnectorError
from kvtool.manager.manager import KvCacheManager


def made_current(stream):
    """A context with `stream` current (a HostStream: nothing to make current)."""
    return torch.cuda.stream(stream) if isinstance(stream, torch.cuda.Stream) else contextlib.nullcontext()


def forward_stream(device: torch.device):
    """The stream the hooks receive: the current CUDA stream for device pools, a HostStream on a CPU."""
    return torch.cuda.current_stream() if device.type == "cuda" else HostStream()

def rank_llm_args(manager: KvCacheManager, spec: ConnectorSpec, options: dict[str, str], rank: int,
                  num_ranks: int, tp_size: int = 1, use_kv_cache_manager_v2: bool = True) -> LlmArgs:
    """The runtime arguments rank `rank`'s connector side is built with (its shard's layer groups;
    `use_kv_cache_manager_v2`: which manager the runtime profile plays)."""
    model = manager.model
    groups = tuple(LayerGroupInfo(g.layer_group_id, tuple(g.layer_ids), g.window_size, g.num_sink_tokens,
                                  g.bytes_per_page) for g in manager.layer_groups)
    kv_config = KvCacheConfig(manager.tokens_per_block, tuple(layer.window_size for layer in model.layers),
                              max(layer.num_sink_tokens for layer in model.layers),
                              use_kv_cache_manager_v2=use_kv_cache_manager_v2)
    all_options = {**spec.options, **options}
    connector_config = KvCacheConnectorConfig(spec.module, spec.scheduler_class.__name__, spec.worker_class.__name__,
                                              server_url=all_options.get("server_url"))
    return LlmArgs(model.shard_name, kv_config, connector_config,
                   groups, model.dtype.name, None, {**spec.options, **options}, rank, num_ranks, tp_size)


def register_worker(worker: KvCacheConnectorWorker, manager: KvCacheManager,
                    registration: Registration = Registration.LAYOUT) -> None:
    """Hand the worker its KV cache as the runtime does: `register_kv_cache_layout(layout)` (V2;
    its default passes a one-pool cache to `register_kv_caches`), or `register_kv_caches` with
    the one primary pool tensor (V1: `[num_blocks, num_layers, kv_factor, block_size]`; a tensor
    on the meta device where the pools are virtual, as in block fidelity)."""
    if registration is Registration.LAYOUT:
        worker.register_kv_cache_layout(manager.layout)
        return
    worker.register_kv_caches(primary_pool_tensor(manager))


def primary_pool_tensor(manager: KvCacheManager) -> torch.Tensor:
    """V1's primary pool: the layout's one pool as `[num_blocks, num_layers, kv_factor, block_size]`
    (ConnectorError where the cache is not one pool of equal buffers; a meta tensor of that shape
    where the pools hold no memory)."""
    layout = manager.layout
    tensor = layout.as_single_pool_tensor()
    if tensor is not None:
        return tensor
    shape = layout.single_pool_shape()
    if shape is None:
        raise ConnectorError(f"this KV cache is not one pool tensor ({layout.num_layer_groups} layer group(s)): "
                             "TensorRT-LLM's V1 registers one primary pool")
    return torch.empty(shape, dtype=layout.dtype, device="meta")
