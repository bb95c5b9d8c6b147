"""`kvtool trace run --compat vllm`: a workload replayed through vLLM 0.32.0's own scheduler and a
vLLM connector, kvtool playing the model (every byte checked), in the keys of `trace.replay.TraceSummary`.

The clock advances `iteration_seconds` a step (kvtool's replay without a cost model: 10 ms), a
request added once the clock reaches its arrival. vLLM's prefix caching is on, as served. Hits: a
request's tokens computed when first scheduled, split between vLLM's own prefix cache (what the
scheduler passed the connector's ask as computed) and the connector (the rest). A key kvtool cannot
read through vLLM is None (the tier's own counts, evictions, deferrals), never a guess.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtool.connector.request import Request
from kvtool.errors import ConnectorError
from kvtool.models import load_model
from kvtool.trace.replay import TraceSummary, token_hit_rate
from kvtool.vllm_compat.driver import VllmRun
from kvtool.vllm_compat.engine_setup import EngineShape, build_engine
from kvtool.vllm_compat.model_config import VllmModel
from kvtool.vllm_compat.target import ConnectorTarget

UNREAD = ("cancelled_tokens", "saved_blocks", "loaded_blocks", "contract_violations", "hook_failures", "deferrals",
          "evictions", "connector_evictions", "bytes_loaded", "bytes_saved", "tier_hit_tokens")
"""TraceSummary keys a vLLM replay cannot read (vLLM's scheduler keeps them to itself, or has no such thing)."""


@dataclass(frozen=True)
class VllmTraceShape:
    """vLLM's engine for a replay: the block size, the pool, the batch limits, the step's seconds."""

    tokens_per_block: int
    num_blocks: int
    """Blocks of the KV cache, vLLM's null block included."""
    max_num_seqs: int
    max_num_batched_tokens: int
    iteration_seconds: float = 0.01


def replay_vllm(requests: Iterable[Request], target: ConnectorTarget, model: str, shape: VllmTraceShape,
                folder: Path, max_steps: int = 1_000_000) -> dict[str, Any]:
    """Every request to its end; the TraceSummary keys (UNREAD ones None). ConnectorError when a
    connector hook raised (`hook_log.HookFailed`) or the replay stopped moving within `max_steps`."""
    started = time.perf_counter()
    pending = list(requests)
    length = max((len(r.prompt_token_ids) + r.max_new_tokens for r in pending), default=1)
    run = _engine(target, model, shape, length, folder)
    asked = _observe_asks(run)
    clock = _drive(run, pending, shape.iteration_seconds, max_steps)
    return _summary(run, asked, pending, target, model, shape, clock, time.perf_counter() - started)


def _engine(target: ConnectorTarget, model: str, shape: VllmTraceShape, length: int, folder: Path) -> VllmRun:
    engine_shape = EngineShape(block_size=shape.tokens_per_block, num_blocks=shape.num_blocks,
                               max_num_batched_tokens=shape.max_num_batched_tokens, max_num_seqs=shape.max_num_seqs,
                               max_model_len=min(length, shape.tokens_per_block * (shape.num_blocks - 1)))
    built = build_engine(VllmModel.of(load_model(model)), engine_shape, target.in_folder(folder), folder / "engine")
    return VllmRun(built)


def _observe_asks(run: VllmRun) -> dict[str, int]:
    """Each request's local hit as vLLM passed it to the connector's last ask (the connector's own
    answer is untouched)."""
    asked: dict[str, int] = {}
    ask = run.connector.get_num_new_matched_tokens

    def observed(request: Any, num_computed_tokens: int) -> Any:
        asked[request.request_id] = num_computed_tokens
        return ask(request, num_computed_tokens)

    run.connector.get_num_new_matched_tokens = observed
    return asked


def _drive(run: VllmRun, pending: list[Request], seconds: float, max_steps: int) -> float:
    """Step vLLM's loop on the replay's clock; the clock at the end."""
    clock, at = 0.0, 0
    for _ in range(max_steps):
        while at < len(pending) and pending[at].arrival <= clock:
            request = pending[at]
            run.add(str(request.request_id), request.prompt_token_ids, max_tokens=max(1, request.max_new_tokens),
                    cache_salt=request.cache_salt)
            at += 1
        if not run.scheduler.has_requests():
            if at == len(pending):
                return clock
            clock = max(clock, pending[at].arrival)
            continue
        run.step()
        clock += seconds
    raise ConnectorError(f"the vLLM replay did not end within {max_steps} steps")


def _summary(run: VllmRun, asked: dict[str, int], pending: list[Request], target: ConnectorTarget, model: str,
             shape: VllmTraceShape, clock: float, wall: float) -> dict[str, Any]:
    outcomes = list(run.outcomes.values())
    prompt = sum(o.prompt_len for o in outcomes)
    first = {o.request_id: o.first_computed or 0 for o in outcomes}
    local = sum(min(asked.get(rid, 0), computed) for rid, computed in first.items())
    hits = sum(first.values())
    generated = sum(len(run.tokens(o.request_id)) - o.prompt_len for o in outcomes)
    computed = sum(sum(step.num_scheduled.values()) for step in run.steps)
    block_bytes = sum(t[0].numel() * t.element_size() for w in run.workers for t in w.tensors.values())
    values: dict[str, Any] = {
        "num_requests": len(pending), "prompt_tokens": prompt, "computed_tokens": computed,
        "local_hit_tokens": local, "connector_hit_tokens": hits - local,
        "integrity_errors": run.integrity.num_wrong, "iterations": len(run.steps), "generated_tokens": generated,
        "failed_requests": sum(o.finish_reason == "error" for o in outcomes),
        "pauses": sum(o.num_preemptions for o in outcomes),
        "recomputed_tokens": max(0, computed - (prompt - hits) - (generated - len(outcomes))),
        "hit_rate": token_hit_rate(local, hits - local, prompt), "simulated_seconds": round(clock, 6),
        "gpu_pool_bytes": shape.num_blocks * block_bytes,
        "gpu_pool_tokens": (shape.num_blocks - 1) * shape.tokens_per_block,
        "fidelity": "bytes", "runtime": "vllm", "invariant_errors": _held_blocks(run), "connector": target.label,
        "model": model, "tokens_per_block": shape.tokens_per_block, "device": "cpu", "wall_seconds": round(wall, 3)}
    return {f.name: values.get(f.name) for f in dataclasses.fields(TraceSummary)}


def _held_blocks(run: VllmRun) -> int:
    """Blocks vLLM still holds once every request ended (a delayed free never reported)."""
    pool = run.scheduler.kv_cache_manager.block_pool
    return sum(1 for b in pool.blocks if b.ref_cnt > 0 and not b.is_null)
