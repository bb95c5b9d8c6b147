"""What a scenario's engine run leaves for the judges: a `RunRecord`, filled once when the run ends.

Judges (`judges`, the scenario modules, `cause_evidence`, `outlived_store`) read a record and its
event log only, never the engine, its runtime, manager or fake engine: what they may judge by is
written down here, and `tests/test_validate_judges_read_records.py` holds them to it. `Phase` and
`FailureReason` are re-exported so that judges need nothing of the engine but its events.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvtool.connector.introspection import Introspection, introspect
from kvtool.connector.runtime import ContractViolation, HookFailure
from kvtool.engine.engine import Engine
from kvtool.engine.events import EventLog
from kvtool.engine.pass_types import IntegrityIssue
from kvtool.engine.request_state import FailureReason, Phase, RequestState

__all__ = ["FailureReason", "IntegrityFindings", "Phase", "RequestOutcome", "RunRecord", "record_run"]


@dataclass(frozen=True)
class RequestOutcome:
    """One request as its run left it."""

    request_id: int
    phase: Phase
    failure: FailureReason | None
    error: str | None
    is_live: bool
    asked: bool
    num_external: int
    """Tokens the connector delivered (its last attempt's, for a paused request)."""
    num_local_hit: int
    num_deferrals: int
    num_pauses: int
    arrival: float
    tokens: list[int]
    """Prompt and generated tokens (`Request.get_tokens`)."""
    generated_token_ids: list[int]

    @classmethod
    def of(cls, state: RequestState) -> RequestOutcome:
        request = state.request
        return cls(state.request_id, state.phase, state.failure, state.error, state.is_live, state.asked,
                   state.num_external, state.num_local_hit, state.num_deferrals, state.num_pauses, request.arrival,
                   list(request.get_tokens()), list(request.generated_token_ids))


@dataclass(frozen=True)
class IntegrityFindings:
    """What the fake engine found wrong in the bytes (rank 0's view, followers' issues included)."""

    issues: tuple[IntegrityIssue, ...] = ()
    errors_by_request: Mapping[int, int] = field(default_factory=dict)
    num_errors: int = 0


@dataclass(frozen=True)
class RunRecord:
    """One engine run of a scenario, as the judges see it."""

    run_id: int = 0
    """Distinct for every run of a process (what `cause_evidence` keys an engine's blocks by)."""
    error: str | None = None
    """Why the run stopped early (`raised.describe_error`), or None."""
    events: EventLog = field(default_factory=EventLog)
    outcomes: Mapping[int, RequestOutcome] = field(default_factory=dict)
    tokens_per_block: int = 0
    integrity: IntegrityFindings = IntegrityFindings()
    failures: tuple[HookFailure, ...] = ()
    """Every hook failure the runtime recorded, in order."""
    violations: tuple[ContractViolation, ...] = ()
    cancels: tuple[tuple[int, int, int], ...] = ()
    """`(request_id, start, end)` of every `cancel_load`-style cancellation the runtime made."""
    introspection: Introspection | None = None
    """What the connector's scheduler said of itself at the end (None: it cannot say)."""
    stream_races: bool = False
    """The run's pages were on a GPU with the streams made to lose (`engine.stream_races`)."""

    def outcome(self, request_id: int) -> RequestOutcome:
        return self.outcomes[request_id]


def record_run(engine: Engine, events: EventLog, error: str | None, run_id: int) -> RunRecord:
    """The record of `engine`'s run, once it has ended (and closed)."""
    runtime, fake = engine.connector, engine.fake
    findings = IntegrityFindings(tuple(getattr(fake, "issues", ())), dict(getattr(fake, "errors_by_request", {})),
                                 engine.integrity_errors)
    return RunRecord(run_id, error, events, {rid: RequestOutcome.of(s) for rid, s in engine.states.items()},
                     engine.manager.tokens_per_block, findings,
                     tuple(runtime.failures) if runtime else (), tuple(runtime.violations) if runtime else (),
                     tuple(runtime.cancels) if runtime else (), introspect(runtime.scheduler) if runtime else None,
                     engine.work is not None and engine.work.races is not None)
