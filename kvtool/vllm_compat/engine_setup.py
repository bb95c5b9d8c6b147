"""vLLM's engine core bring-up, without a model: the `VllmConfig` over a local config, the KV cache
configuration as the engine core computes it, vLLM's own `Scheduler` (which builds the connector's
scheduler side and the `KVCacheManager`), and the request block hasher.

This follows vLLM 0.32.0's `EngineCore._initialize_kv_caches` (`get_kv_cache_configs`,
`generate_scheduler_kv_cache_config`, `num_gpu_blocks` set before the scheduler) and its
`init_none_hash` / `get_request_block_hasher`. The KV cache layout is resolved as the engine core
resolves it: the connector's `get_required_kvcache_layout` when it names one, else `LBHNC` (the CPU
attention backend's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtool.models import shard_model
from kvtool.vllm_compat.install import require_vllm
from kvtool.vllm_compat.model_config import VllmModel
from kvtool.vllm_compat.target import ConnectorTarget

DEFAULT_LAYOUT = "LBHNC"
"""The layout vLLM's CPU attention backend supports (its `get_supported_kernel_block_sizes` aside)."""


@dataclass(frozen=True)
class EngineShape:
    """What a scenario sets of vLLM's scheduler and cache configuration."""

    block_size: int = 4
    num_blocks: int = 160
    """Blocks of the KV cache, the null block (id 0) included."""
    blocks_per_group: int | None = None
    """Instead of `num_blocks`: about this many blocks for each KV cache group vLLM makes (a hybrid
    model's groups share one pool), for a scenario that wants a small cache on every model."""
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 8
    max_model_len: int = 128
    prefix_caching: bool = True
    load_failure_policy: str = "fail"
    """`kv_load_failure_policy`: "fail" (the request fails) or "recompute"."""
    num_workers: int = 1
    """Workers (tensor-parallel ranks), each with its shard of the heads and its own connector."""


@dataclass
class BuiltEngine:
    """vLLM's objects for one run: configuration, scheduler, each worker's KV cache configuration."""

    model: VllmModel
    shape: EngineShape
    vllm_config: Any
    scheduler: Any
    worker_kv_configs: list[Any]
    worker_models: list[VllmModel]
    block_hasher: Callable[[Any], list[Any]]
    group_of_layer: dict[str, int] = field(default_factory=dict)
    sliding_window_of_group: dict[int, int | None] = field(default_factory=dict)


def build_engine(model: VllmModel, shape: EngineShape, target: ConnectorTarget, folder: Path) -> BuiltEngine:
    """vLLM's configuration and scheduler for `model` with `target` attached, the model's config
    written into `folder`. Construction errors of vLLM or the connector propagate."""
    require_vllm()
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_kv_cache_configs,
        get_request_block_hasher,
        init_none_hash,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    config = _vllm_config(model, shape, target, folder)
    _parallel_groups(config, folder)
    workers = [VllmModel(shard_model(model.spec, shape.num_workers, rank)) if shape.num_workers > 1 else model
               for rank in range(shape.num_workers)]
    specs = [_layer_specs(w, shape) for w in workers]
    if shape.blocks_per_group is not None:
        groups = len(get_kv_cache_configs(config, specs, [1 << 40] * shape.num_workers)[0].kv_cache_groups)
        config.cache_config.num_gpu_blocks_override = 2 + (shape.blocks_per_group + 1) * groups
    kv_configs = get_kv_cache_configs(config, specs, [1 << 40] * shape.num_workers)
    scheduler_kv = generate_scheduler_kv_cache_config(kv_configs)
    config.cache_config.num_gpu_blocks = scheduler_kv.num_blocks
    scheduler = Scheduler(vllm_config=config, kv_cache_config=scheduler_kv,
                          structured_output_manager=StructuredOutputManager(config),
                          block_size=shape.block_size, log_stats=True)
    init_none_hash(sha256)
    built = BuiltEngine(model, shape, config, scheduler, kv_configs, workers,
                        get_request_block_hasher(shape.block_size, sha256))
    for index, group in enumerate(scheduler_kv.kv_cache_groups):
        built.group_of_layer.update({name: index for name in group.layer_names})
        built.sliding_window_of_group[index] = getattr(group.kv_cache_spec, "sliding_window", None)
    return built


def _parallel_groups(config: Any, folder: Path) -> None:
    """vLLM's process groups of a one-process world (gloo), as its CPU worker initializes them
    (`init_distributed_environment`, `ensure_model_parallel_initialized`), once per process: some
    connectors ask `get_tp_group()` when they start (LMCache's does). kvtool plays every worker in
    this one process, so a connector that reads its rank from the group sees rank 0 of 1 on each."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return
    folder.mkdir(parents=True, exist_ok=True)
    with set_current_vllm_config(config):
        parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                    distributed_init_method=f"file://{folder.resolve()}/groups")
        parallel_state.ensure_model_parallel_initialized(1, 1)


def _vllm_config(model: VllmModel, shape: EngineShape, target: ConnectorTarget, folder: Path) -> Any:
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig

    model_config = ModelConfig(model=str(model.write_config(folder / "model")), skip_tokenizer_init=True,
                               dtype=model.dtype_name, max_model_len=shape.max_model_len, seed=0)
    scheduler_config = SchedulerConfig(max_num_seqs=shape.max_num_seqs, max_model_len=shape.max_model_len,
                                       max_num_batched_tokens=shape.max_num_batched_tokens,
                                       enable_chunked_prefill=True, is_encoder_decoder=False)
    cache_config = CacheConfig(block_size=shape.block_size, enable_prefix_caching=shape.prefix_caching,
                               num_gpu_blocks_override=shape.num_blocks)
    transfer = KVTransferConfig(kv_connector=target.name, kv_role="kv_both",
                                kv_connector_module_path=target.module_path,
                                kv_connector_extra_config=dict(target.extra),
                                kv_load_failure_policy=shape.load_failure_policy)  # type: ignore[arg-type]
    config = VllmConfig(model_config=model_config, cache_config=cache_config, scheduler_config=scheduler_config,
                        kv_transfer_config=transfer, device_config=DeviceConfig("cpu"))
    config.cache_config.kv_cache_layout = _layout(config)
    return config


def _layout(config: Any) -> str:
    """What the engine core would resolve with no preset and no environment variable: the
    connector's required layout, else the CPU backend's."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    connector_class = KVConnectorFactory.get_connector_class(config.kv_transfer_config)
    required = connector_class.get_required_kvcache_layout(config)
    return str(required) if required else DEFAULT_LAYOUT


def _layer_specs(model: VllmModel, shape: EngineShape) -> dict[str, Any]:
    """What each attention layer's `get_kv_cache_spec()` returns for this worker's shard."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    dtype = getattr(torch, model.dtype_name)
    common = dict(block_size=shape.block_size, num_kv_heads=model.num_kv_heads, head_size=model.head_dim,
                  dtype=dtype)
    return {name: FullAttentionSpec(**common) if window is None else SlidingWindowSpec(sliding_window=window,
                                                                                         **common)
            for name, window in model.windows().items()}
