"""The names of the runtime profiles (a module of its own: `EngineConfig` names a runtime without
importing what plays it)."""

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
