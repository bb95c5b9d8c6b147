"""Replaying a workload through the bundled manager, scheduler, fake engine and a connector.

Token-weighted hit rate = (local hit tokens + connector hit tokens) / prompt tokens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvtool.connector.introspection import introspect
from kvtool.connector.loader import ConnectorSpec
from kvtool.connector.request import Request
from kvtool.engine.engine import Engine, EngineConfig
from kvtool.engine.events import Subscriber
from kvtool.errors import InputError, LogicError
from kvtool.manager.integrity import check_manager
from kvtool.trace.cost_model import CostModel
from kvtool.trace.recorder import TraceRecorder
from kvtool.types import Fidelity


@dataclass(frozen=True)
class TraceSummary:
    """What one replay did. Token counts are prompt tokens unless said otherwise."""

    num_requests: int
    """Requests in the workload."""
    prompt_tokens: int
    """Sum of the prompt lengths."""
    computed_tokens: int
    """Tokens the fake model computed: prefill chunks plus one per generation step."""
    local_hit_tokens: int
    """Prompt tokens served from the local radix tree (no compute, no transfer)."""
    connector_hit_tokens: int
    """Prompt tokens the connector delivered (loaded, not computed)."""
    cancelled_tokens: int
    """Offered tokens handed back through `cancel_load` (clamped, not reserved, or found locally)."""
    saved_blocks: int | None
    """Blocks the connector saved, as its introspection reports; None when it does not."""
    loaded_blocks: int | None
    """Blocks the connector loaded, as its introspection reports; None when it does not."""
    integrity_errors: int
    """Reads of KV bytes whose fingerprint did not match (wrong, stale or missing data)."""
    iterations: int
    """Engine iterations (scheduler steps) until every request finished."""
    generated_tokens: int
    """Tokens sampled, over all requests."""
    failed_requests: int
    """Requests that ended FAILED (a connector hook raised, a load never landed, ...)."""
    contract_violations: int
    """Answers of the connector outside the API's contract (repaired by the runtime)."""
    hook_failures: int
    """Connector hooks that raised."""
    deferrals: int
    """Times a waiting request could not get pages and was put back."""
    pauses: int
    """Times a running request's allocation was taken back (--admission max-utilization)."""
    recomputed_tokens: int
    """Tokens computed again after a pause (computed before it, neither reused locally nor loaded)."""
    evictions: int
    """Cached pages the radix tree lost to make room."""
    connector_evictions: int | None
    """Entries the connector's tier dropped to make room, as its introspection reports."""
    bytes_loaded: int | None
    """KV bytes the connector loaded into the cache (loaded blocks x bytes of one block)."""
    bytes_saved: int | None
    """KV bytes the connector saved from the cache (saved blocks x bytes of one block)."""
    hit_rate: float
    """Token-weighted hit rate: (local_hit_tokens + connector_hit_tokens) / prompt_tokens."""
    simulated_seconds: float
    """The replay's clock at the end (the cost model's seconds, or 10 ms an iteration)."""
    gpu_pool_bytes: int
    """Bytes of the GPU pool (rank 0's: a GPU's shard), every pool group."""
    gpu_pool_tokens: int
    """Tokens the GPU pool holds (its smallest pool group's slots x tokens per block)."""
    tier_hit_tokens: dict[str, int] | None
    """Connector hit tokens per tier, for a connector of several tiers (stacked); None otherwise."""
    fidelity: Fidelity
    runtime: str
    """The TensorRT-LLM runtime the engine played (`--runtime`)."""
    invariant_errors: int
    """Manager invariants broken after the replay (leaked caches or holds included)."""
    connector: str
    model: str
    tokens_per_block: int
    device: str
    wall_seconds: float
    """Real seconds the replay took on this machine."""

    def as_dict(self) -> dict[str, Any]:
        """Field name -> value, in declaration order (the JSON report)."""
        return dataclasses.asdict(self)


def token_hit_rate(local_hit_tokens: int, connector_hit_tokens: int, prompt_tokens: int) -> float:
    """The token-weighted hit rate (the module's definition), to 6 decimals; 0 without prompt tokens."""
    if not prompt_tokens:
        return 0.0
    return round((local_hit_tokens + connector_hit_tokens) / prompt_tokens, 6)


@dataclass
class TraceResult:
    summary: TraceSummary
    issues: list[str] = field(default_factory=list)
    recorder: TraceRecorder = field(default_factory=TraceRecorder)
    """Rows per request and per iteration."""

    @property
    def failed_checks(self) -> list[str]:
        s = self.summary
        reasons = []
        if s.integrity_errors:
            reasons.append(f"{s.integrity_errors} integrity errors")
        if s.failed_requests:
            reasons.append(f"{s.failed_requests} failed requests")
        if s.contract_violations:
            reasons.append(f"{s.contract_violations} connector contract violations")
        if s.invariant_errors:
            reasons.append("runtime invariants failed")
        return reasons


def run_trace(requests: Iterable[Request], config: EngineConfig, connector: ConnectorSpec | None,
              connector_options: dict[str, str] | None = None,
              on_iteration: Callable[[Engine], None] | None = None, subscribers: Iterable[Subscriber] = (),
              keep_iterations: bool = True) -> TraceResult:
    """Replay `requests` (read as the clock reaches them; arrivals must not decrease)."""
    started = time.perf_counter()
    engine = Engine(dataclasses.replace(config, forget_finished=True), connector, connector_options)
    cost = getattr(config.iteration_time, "__self__", None)
    if isinstance(cost, CostModel):        # the cost model reads this replay's connector's tier splits
        cost.split.bind(engine.connector.scheduler if engine.connector else None)
    recorder = TraceRecorder(keep_iterations)
    engine.events.subscribe(recorder)
    for subscriber in subscribers:
        engine.events.subscribe(subscriber)
    try:
        with _collect_every(GC_EVERY_ITERATIONS) as collect:
            def each_iteration(e: Engine) -> None:
                collect(e.iteration)
                if on_iteration is not None:
                    on_iteration(e)
            engine.run_stream(_in_arrival_order(requests), on_iteration=each_iteration)
    finally:
        engine.close()
    recorder.flush()
    invariant_errors = _invariant_errors(engine)
    summary = _summary(engine, recorder, connector, time.perf_counter() - started, invariant_errors)
    return TraceResult(summary, _issues(engine, invariant_errors), recorder)


GC_EVERY_ITERATIONS = 4096


@contextlib.contextmanager
def _collect_every(iterations: int):
    """Python's automatic collector off, a full collection every `iterations` iterations instead,
    over what the replay allocated only: the objects that exist when it starts (the imported
    modules, torch's hundreds of thousands among them) are frozen out of every collection until
    it ends. The automatic collector would rescan long-lived objects again and again, while the
    manager breaks its own reference cycles when it frees them."""
    was_enabled = gc.isenabled()
    gc.disable()
    gc.freeze()
    try:
        yield lambda iteration: gc.collect() if iteration % iterations == 0 else None
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()


def _in_arrival_order(requests: Iterable[Request]):
    """The requests, InputError at the first whose arrival is earlier than the one before."""
    latest = 0.0
    for request in requests:
        if request.arrival < latest:
            raise InputError(f"request {request.request_id} arrives at {request.arrival:g} s, before the "
                             f"request ahead of it ({latest:g} s): a workload lists requests in arrival order")
        latest = request.arrival
        yield request


def _invariant_errors(engine: Engine) -> list[str]:
    errors = []
    try:
        check_manager(engine.manager)
    except LogicError as exc:
        errors.append(str(exc))
    if engine.manager.caches or engine.manager.holds:
        errors.append(f"{len(engine.manager.caches)} caches and {len(engine.manager.holds)} holds "
                      "outlived their requests")
    return errors


def _summary(engine: Engine, recorder: TraceRecorder, connector: ConnectorSpec | None, seconds: float,
             invariant_errors: list[str]) -> TraceSummary:
    runtime = engine.connector
    said = introspect(runtime.scheduler) if runtime else None
    counters = said.as_dict() if said is not None else {}
    rows = recorder.requests + recorder.unfinished
    prompt_tokens = sum(r.prompt_len for r in rows)
    local = sum(r.local_hit_tokens for r in rows)
    external = sum(r.connector_hit_tokens for r in rows)
    block_bytes = engine.manager.layout.bytes_per_block
    saved, loaded = counters.get("saved_blocks"), counters.get("loaded_blocks")
    return TraceSummary(
        num_requests=len(rows),
        prompt_tokens=prompt_tokens,
        computed_tokens=engine.stats.computed_tokens,
        local_hit_tokens=local,
        connector_hit_tokens=external,
        cancelled_tokens=recorder.cancelled_tokens,
        saved_blocks=saved,
        loaded_blocks=loaded,
        integrity_errors=engine.integrity_errors,
        iterations=engine.stats.iterations,
        generated_tokens=engine.stats.generated_tokens,
        failed_requests=sum(r.failure is not None for r in recorder.requests),
        contract_violations=len(runtime.violations) if runtime else 0,
        hook_failures=len(runtime.failures) if runtime else 0,
        deferrals=engine.stats.num_deferrals,
        pauses=engine.stats.num_pauses,
        recomputed_tokens=engine.stats.recomputed_tokens,
        evictions=engine.manager.page_table.num_evictions,
        connector_evictions=counters.get("evicted_entries"),
        bytes_loaded=None if loaded is None else loaded * block_bytes,
        bytes_saved=None if saved is None else saved * block_bytes,
        hit_rate=token_hit_rate(local, external, prompt_tokens),
        simulated_seconds=round(engine.clock, 6),
        gpu_pool_bytes=sum(pg.slot_bytes * pg.num_slots for pg in engine.manager.layout.pool_groups),
        gpu_pool_tokens=min(engine.manager.num_slots) * engine.manager.tokens_per_block,
        tier_hit_tokens=dict(said.tier_hit_tokens) if said is not None and said.tier_hit_tokens else None,
        fidelity=engine.config.fidelity,
        runtime=str(engine.config.runtime),
        invariant_errors=len(invariant_errors),
        connector=connector.name if connector else "none",
        model=engine.config.manager.model.name,
        tokens_per_block=engine.manager.tokens_per_block,
        device="virtual" if engine.manager.layout.is_virtual else str(engine.manager.device),
        wall_seconds=round(seconds, 3),
    )


def _issues(engine: Engine, invariant_errors: list[str]) -> list[str]:
    lines = [issue.describe() for issue in engine.fake.issues[:10]]
    lines += engine.stats.failures[:10]
    if engine.connector:
        lines += [f"contract: {v.check}: {v.detail}" for v in engine.connector.violations[:10]]
        lines += [f"hook: {f.describe()}" for f in engine.connector.failures[:10]]
    return lines + invariant_errors
