"""The names of the runtime profiles and of the ways a worker is handed its cache (a module of its
own: `EngineConfig` and a follower's setup name them without importing what plays them)."""

from __future__ import annotations

from kvtool.types import TextEnum


class RuntimeName(TextEnum):
    """The runtimes a TensorRT-LLM connector meets (late 2026)."""

    TRTLLM_V1 = "trtllm-v1"
    """The V1 KV cache manager: `use_kv_cache_manager_v2="auto"` for every model without a V2
    preference of its own (Llama among them), so the runtime most connectors meet."""
    TRTLLM_V2 = "trtllm-v2"
    """`main`'s KVCacheManagerV2 (#18762 and later): the final-batch ask, prefix reservations."""
    TRTLLM_V2_RELEASE = "trtllm-v2-release"
    """The release branches' KVCacheManagerV2 (#18700, a cherry-pick of #17974): the ask during
    scheduling, a deferral after it, `cancel_load`."""


DEFAULT_RUNTIME = RuntimeName.TRTLLM_V2_RELEASE
"""`bench` and `trace`'s runtime unless `--runtime` says otherwise: the one every figure kvtool
committed before profiles existed was measured under."""


class Registration(TextEnum):
    """How a worker is handed the KV cache at bring-up (the hook that is called)."""

    LAYOUT = "register_kv_cache_layout"
    """The layout (regions per layer group); its default passes a one-pool cache to `register_kv_caches`."""
    POOL_TENSOR = "register_kv_caches"
    """The one primary pool tensor `[num_blocks, num_layers, kv_factor, block_size]`, nothing else."""


VLLM_RUNTIME = "vllm"
"""vLLM's own engine (`--compat vllm`, `kvtool.vllm_compat`): not a profile over kvtool's engine but
vLLM 0.32.0's scheduler and KV cache manager, driven for real; the runtime its results name."""
