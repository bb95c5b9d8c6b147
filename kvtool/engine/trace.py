"""Replaying a workload through the bundled manager, scheduler, fake engine and a connector."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from kvtool.connector.loader import ConnectorSpec
from kvtool.connector.request import Request
from kvtool.engine.engine import Engine, EngineConfig
from kvtool.engine.events import Cancel, Deliver, EventLog, Evicted, Finished
from kvtool.errors import LogicError
from kvtool.manager.integrity import check_manager


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
    """Blocks the connector saved, as its `kvtool_introspect` reports; None when it does not."""
    loaded_blocks: int | None
    """Blocks the connector loaded, as its `kvtool_introspect` reports; None when it does not."""
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
    evictions: int
    """Cached pages the radix tree lost to make room."""
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


@dataclass
class TraceResult:
    summary: TraceSummary
    issues: list[str] = field(default_factory=list)
    events: EventLog = field(default_factory=EventLog)

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


def run_trace(requests: list[Request], config: EngineConfig, connector: ConnectorSpec | None,
              connector_options: dict[str, str] | None = None,
              on_iteration: Callable[[Engine], None] | None = None) -> TraceResult:
    started = time.perf_counter()
    engine = Engine(config, connector, connector_options)
    log = EventLog()
    engine.events.subscribe(log)
    try:
        for request in requests:
            engine.add_request(request)
        engine.run(on_iteration=on_iteration)
    finally:
        engine.close()
    invariant_errors = _invariant_errors(engine)
    summary = _summary(engine, log, requests, connector, time.perf_counter() - started, invariant_errors)
    return TraceResult(summary, _issues(engine, invariant_errors), log)


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


def _summary(engine: Engine, log: EventLog, requests: list[Request], connector: ConnectorSpec | None,
             seconds: float, invariant_errors: list[str]) -> TraceSummary:
    runtime = engine.connector
    introspect = getattr(runtime.scheduler, "kvtool_introspect", None) if runtime else None
    counters = introspect() if callable(introspect) else {}
    return TraceSummary(
        num_requests=len(requests),
        prompt_tokens=sum(r.prompt_len for r in requests),
        computed_tokens=engine.stats.computed_tokens,
        local_hit_tokens=sum(s.num_local_hit for s in engine.states.values()),
        connector_hit_tokens=sum(e.num_external for e in log.of(Deliver)),
        cancelled_tokens=sum(e.end - e.start for e in log.of(Cancel)),
        saved_blocks=counters.get("saved_blocks"),
        loaded_blocks=counters.get("loaded_blocks"),
        integrity_errors=engine.integrity_errors,
        iterations=engine.stats.iterations,
        generated_tokens=engine.stats.generated_tokens,
        failed_requests=sum(e.failure is not None for e in log.of(Finished)),
        contract_violations=len(runtime.violations) if runtime else 0,
        hook_failures=len(runtime.failures) if runtime else 0,
        deferrals=engine.stats.num_deferrals,
        evictions=len(log.of(Evicted)),
        invariant_errors=len(invariant_errors),
        connector=connector.name if connector else "none",
        model=engine.config.manager.model.name,
        tokens_per_block=engine.manager.tokens_per_block,
        device=str(engine.manager.device),
        wall_seconds=round(seconds, 3),
    )


def _issues(engine: Engine, invariant_errors: list[str]) -> list[str]:
    lines = [issue.describe() for issue in engine.fake.issues[:10]]
    lines += engine.stats.failures[:10]
    if engine.connector:
        lines += [f"contract: {v.check}: {v.detail}" for v in engine.connector.violations[:10]]
        lines += [f"hook: {f.describe()}" for f in engine.connector.failures[:10]]
    return lines + invariant_errors
