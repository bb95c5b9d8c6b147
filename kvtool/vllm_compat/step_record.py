"""What a step and a request leave for the judges, as plain values (no vLLM object outlives a step):
each step's scheduling (new requests with their block ids and computed count, running ones with
their appended or resumed blocks, finished and preempted ids, sync loads) and its connector output
(finished sending / receiving, failed loads, invalid blocks), and each request's outcome.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Outcome:
    """One request over the run."""

    request_id: str
    prompt_len: int
    first_computed: int | None = None
    """`num_computed_tokens` when it was first scheduled (local prefix cache hit + connector's)."""
    computed_at_schedule: list[int] = field(default_factory=list)
    """`num_computed_tokens` at every scheduling as a new or resumed request."""
    finish_reason: str | None = None
    """vLLM's: "length", "abort", "error", ... (None: unfinished)."""
    num_tokens: int = 0
    """Tokens it generated (vLLM's outputs)."""
    num_preemptions: int = 0


@dataclass(frozen=True)
class StepRecord:
    index: int
    new: tuple[tuple[str, tuple[tuple[int, ...], ...], int], ...]
    """(request id, block ids per group, num_computed_tokens) of each new request."""
    resumed: tuple[tuple[str, tuple[tuple[int, ...], ...], int], ...]
    """The same for each preempted request scheduled again (its whole block list)."""
    num_scheduled: dict[str, int]
    finished_req_ids: frozenset[str]
    preempted: frozenset[str]
    has_sync_kv_loads: bool
    finished_sending: frozenset[str]
    finished_recving: frozenset[str]
    failed_recving: frozenset[str]
    invalid_block_ids: frozenset[int]


def record_step(index: int, output: Any, kv: Any, engine_outputs: Any, outcomes: dict[str, Outcome]) -> StepRecord:
    """The step's record; `outcomes` updated from the scheduling and vLLM's engine outputs."""
    new = tuple((r.req_id, _groups(r.block_ids), r.num_computed_tokens) for r in output.scheduled_new_reqs)
    cached = output.scheduled_cached_reqs
    resumed = tuple((rid, _groups(cached.new_block_ids[i]), cached.num_computed_tokens[i])
                    for i, rid in enumerate(cached.req_ids) if rid in cached.resumed_req_ids)
    for rid, _, computed in new + resumed:
        outcome = outcomes[rid]
        outcome.first_computed = computed if outcome.first_computed is None else outcome.first_computed
        outcome.computed_at_schedule.append(computed)
    for rid in output.preempted_req_ids or ():
        outcomes[rid].num_preemptions += 1
    _note_finished(engine_outputs, outcomes)
    return StepRecord(index, new, resumed, dict(output.num_scheduled_tokens), frozenset(output.finished_req_ids),
                      frozenset(output.preempted_req_ids or ()), bool(output.has_sync_kv_loads),
                      _ids(kv, "finished_sending"), _ids(kv, "finished_recving"), _ids(kv, "failed_recving"),
                      frozenset(getattr(kv, "invalid_block_ids", None) or ()))


def _note_finished(engine_outputs: Any, outcomes: dict[str, Outcome]) -> None:
    for client_outputs in (engine_outputs or {}).values():
        for out in client_outputs.outputs:
            outcome = outcomes.get(out.request_id)
            if outcome is None:
                continue
            outcome.num_tokens += len(out.new_token_ids)
            if out.finish_reason is not None:
                outcome.finish_reason = str(out.finish_reason)


def _groups(block_ids: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(group) for group in block_ids or ())


def _ids(kv: Any, name: str) -> frozenset[str]:
    return frozenset(getattr(kv, name, None) or ())
