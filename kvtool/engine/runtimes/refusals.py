"""What TensorRT-LLM refuses at bring-up when a connector is attached, per check, in its terms.

Each function reads a `BringUp` and returns the refusal (one line) or None. The phrases TensorRT-LLM's
own tests match on ("cache tiers below GPU", "host offloading", "VSWA", "guaranteed no evict",
"speculative decoding", "prefix reservations require") are kept, so a test written against
TensorRT-LLM's messages matches kvtool's. Sources: `py_executor.py` `_maybe_init_kv_connector_manager`
and `_reject_non_gpu_cache_tiers`, `py_executor_creator.py` (the capacity policy), the connector
manager's `configure_prefix_reservations` (NVIDIA/TensorRT-LLM@10b8fbd9, connectors at 035ab91c).
"""

from __future__ import annotations

from kvtool.engine.runtimes.profile import BringUp, CapacityPolicy


def gpu_tier_only(bring_up: BringUp) -> str | None:
    """KVCacheManagerV2: no tier below the GPU (an evicted page's slot is reassigned)."""
    if not bring_up.host_cache_bytes and not bring_up.disk_cache_bytes:
        return None
    return ("a KV cache connector is not supported with KVCacheManagerV2 cache tiers below GPU: set the host "
            f"cache size (now {bring_up.host_cache_bytes}) and the disk cache size (now {bring_up.disk_cache_bytes}) "
            "to 0 (an evicted page's GPU slot is reassigned, so the addresses the connector registered would go stale)")


def no_host_offloading(bring_up: BringUp) -> str | None:
    """V1: no secondary (host) pool; the worker is registered with the primary pool only."""
    if not bring_up.host_cache_bytes and not bring_up.disk_cache_bytes:
        return None
    return ("a KV cache connector is not supported with KV cache host offloading (host cache size "
            f"{bring_up.host_cache_bytes}, disk cache size {bring_up.disk_cache_bytes}): the connector worker is "
            "registered with the primary (GPU) pool only and cannot reach blocks offloaded to the secondary pool")


def single_window(bring_up: BringUp) -> str | None:
    """V1: one primary pool, so one window size (VSWA models have a pool per window)."""
    windows = bring_up.window_sizes
    if len(windows) > 1:
        shown = ", ".join("full" if w is None else str(w) for w in sorted(windows, key=lambda w: w or 1 << 62))
        return ("a KV cache connector is not supported with variable sliding-window attention (VSWA: windows "
                f"{shown}): the connector is registered with a single primary pool, and a VSWA model has one "
                "pool per window size")
    if windows != {None}:
        return ("kvtool's trtllm-v1 profile does not run sliding-window attention: TensorRT-LLM's V1 runs a "
                "uniform window, but its block hashes fail once a request's front blocks detach "
                "('commitAndGetBlockHashesForRequest does not support sliding-window attention with detached "
                "front blocks'); validate such a model under trtllm-v2")
    return None


def guaranteed_no_evict(bring_up: BringUp) -> str | None:
    """V1: the capacity scheduler must be GUARANTEED_NO_EVICT (no pausing, no greedy admission)."""
    if bring_up.capacity_policy is CapacityPolicy.GUARANTEED_NO_EVICT:
        return None
    return ("a KV cache connector is only supported with the guaranteed no evict scheduler policy "
            f"(GUARANTEED_NO_EVICT); this run admits with {bring_up.capacity_policy} (--admission reserve)")


def no_speculative_decoding(bring_up: BringUp) -> str | None:
    """`main`'s V2: no draft tokens with a connector."""
    if not bring_up.draft_tokens:
        return None
    return (f"a KV cache connector is not supported with speculative decoding on KVCacheManagerV2 "
            f"({bring_up.draft_tokens} draft tokens a step)")


def first(*refusals: str | None) -> str | None:
    """The first refusal that applies, in TensorRT-LLM's order of checks."""
    return next((r for r in refusals if r is not None), None)
