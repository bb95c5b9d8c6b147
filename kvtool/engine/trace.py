"""Replaying a workload through the bundled manager, scheduler, fake engine and a connector."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from kvtool.connector.loader import ConnectorSpec
from kvtool.connector.request import Request
from kvtool.engine.engine import Engine, EngineConfig
from kvtool.engine.request_state import Phase
from kvtool.errors import LogicError
from kvtool.manager.integrity import check_manager

SUMMARY_KEYS = ("num_requests", "prompt_tokens", "computed_tokens", "local_hit_tokens", "connector_hit_tokens",
                "cancelled_tokens", "saved_blocks", "loaded_blocks", "integrity_errors", "iterations")


@dataclass
class TraceResult:
    summary: dict[str, Any]
    issues: list[str] = field(default_factory=list)

    @property
    def failed_checks(self) -> list[str]:
        s = self.summary
        reasons = []
        if s["integrity_errors"]:
            reasons.append(f"{s['integrity_errors']} integrity errors")
        if s["failed_requests"]:
            reasons.append(f"{s['failed_requests']} failed requests")
        if s["contract_violations"]:
            reasons.append(f"{s['contract_violations']} connector contract violations")
        if s["invariant_errors"]:
            reasons.append("runtime invariants failed")
        return reasons


def run_trace(requests: list[Request], config: EngineConfig, connector: ConnectorSpec | None,
              connector_options: dict[str, str] | None = None,
              on_iteration: Callable[[Engine], None] | None = None) -> TraceResult:
    started = time.perf_counter()
    engine = Engine(config, connector, connector_options)
    for request in requests:
        engine.add_request(request)
    engine.run(on_iteration=on_iteration)
    invariant_errors = []
    try:
        check_manager(engine.manager)
    except LogicError as exc:
        invariant_errors.append(str(exc))
    if engine.manager.caches or engine.manager.holds:
        invariant_errors.append(f"{len(engine.manager.caches)} caches and {len(engine.manager.holds)} holds "
                                "outlived their requests")
    return TraceResult(_summary(engine, requests, connector, time.perf_counter() - started, invariant_errors),
                       _issues(engine, invariant_errors))


def _summary(engine: Engine, requests: list[Request], connector: ConnectorSpec | None, seconds: float,
             invariant_errors: list[str]) -> dict[str, Any]:
    states = list(engine.states.values())
    runtime = engine.connector
    introspect = getattr(runtime.scheduler, "kvtool_introspect", None) if runtime else None
    counters = introspect() if callable(introspect) else {}
    return {
        "num_requests": len(requests),
        "prompt_tokens": sum(r.prompt_len for r in requests),
        "computed_tokens": engine.stats.computed_tokens,
        "local_hit_tokens": sum(s.num_local_hit for s in states),
        "connector_hit_tokens": sum(s.num_external for s in states),
        "cancelled_tokens": runtime.num_cancelled_tokens if runtime else 0,
        "saved_blocks": counters.get("saved_blocks"),
        "loaded_blocks": counters.get("loaded_blocks"),
        "integrity_errors": engine.integrity_errors,
        "iterations": engine.stats.iterations,
        "generated_tokens": engine.stats.generated_tokens,
        "failed_requests": sum(s.phase is Phase.FAILED for s in states),
        "contract_violations": len(runtime.violations) if runtime else 0,
        "hook_failures": len(runtime.failures) if runtime else 0,
        "deferrals": engine.stats.num_deferrals,
        "evictions": engine.manager.page_table.num_evictions,
        "invariant_errors": len(invariant_errors),
        "connector": connector.name if connector else "none",
        "model": engine.config.manager.model.name,
        "tokens_per_block": engine.manager.tokens_per_block,
        "device": str(engine.manager.device),
        "wall_seconds": round(seconds, 3),
    }


def _issues(engine: Engine, invariant_errors: list[str]) -> list[str]:
    lines = [issue.describe() for issue in engine.fake.issues[:10]]
    lines += engine.stats.failures[:10]
    if engine.connector:
        lines += [f"contract: {v.check}: {v.detail}" for v in engine.connector.violations[:10]]
        lines += [f"hook: {f.describe()}" for f in engine.connector.failures[:10]]
    return lines + invariant_errors
