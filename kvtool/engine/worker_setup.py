"""How a rank's connector worker is built and given its KV cache: the runtime arguments of its
shard, the layout (or the single pool tensor for a worker that only takes one), and the stream its
hooks receive."""

from __future__ import annotations

import contextlib

import torch

from kvtool.connector.api import HostStream, KvCacheConnectorWorker
from kvtool.connector.llm_args import KvCacheConfig, KvCacheConnectorConfig, LayerGroupInfo, LlmArgs
from kvtool.connector.loader import ConnectorSpec
from kvtool.manager.manager import KvCacheManager


def made_current(stream):
    """A context with `stream` current (a HostStream: nothing to make current)."""
    return torch.cuda.stream(stream) if isinstance(stream, torch.cuda.Stream) else contextlib.nullcontext()


def forward_stream(device: torch.device):
    """The stream the hooks receive: the current CUDA stream for device pools, a HostStream on a CPU."""
    return torch.cuda.current_stream() if device.type == "cuda" else HostStream()

def rank_llm_args(manager: KvCacheManager, spec: ConnectorSpec, options: dict[str, str], rank: int,
                  num_ranks: int, tp_size: int = 1) -> LlmArgs:
    """The runtime arguments rank `rank`'s connector side is built with (its shard's layer groups)."""
    model = manager.model
    groups = tuple(LayerGroupInfo(g.layer_group_id, tuple(g.layer_ids), g.window_size, g.num_sink_tokens,
                                  g.bytes_per_page) for g in manager.layer_groups)
    kv_config = KvCacheConfig(manager.tokens_per_block, tuple(layer.window_size for layer in model.layers),
                              max(layer.num_sink_tokens for layer in model.layers))
    all_options = {**spec.options, **options}
    connector_config = KvCacheConnectorConfig(spec.module, spec.scheduler_class.__name__, spec.worker_class.__name__,
                                              server_url=all_options.get("server_url"))
    return LlmArgs(model.shard_name, kv_config, connector_config,
                   groups, model.dtype.name, None, {**spec.options, **options}, rank, num_ranks, tp_size)


def register_worker(worker: KvCacheConnectorWorker, manager: KvCacheManager) -> None:
    """Hand the worker the layout: `register_kv_cache_layout`, whose default passes a one-pool
    cache to `register_kv_caches` (as TensorRT-LLM does)."""
    worker.register_kv_cache_layout(manager.layout)
