"""The judges every scenario shares: each reads a run's `RunRecord` (and its event log) and gives
a `CheckResult`; none reads the engine (`run_record` says why)."""

from __future__ import annotations

from dataclasses import replace

from kvtool.engine.events import (
    Ask,
    Deliver,
    Finished,
    LoadStarted,
    PrefixLoadRetired,
    ReservationReleased,
    Reserved,
    SaveFinished,
    SaveStarted,
)
from kvtool.validate.cause_evidence import released_page_loads
from kvtool.validate.harness import Context, Req, reference_tokens
from kvtool.validate.outlived_store import follower_store_lacks, store_outlived_engine
from kvtool.validate.results import CheckResult, Verdict, verdict
from kvtool.validate.run_record import FailureReason, Phase, RunRecord


def result(scenario: str, ctx: Context, check: str, ok: bool, evidence: list[str]) -> CheckResult:
    return CheckResult(scenario, ctx.model, check, verdict(ok), 0.0, evidence if not ok else evidence[:3])


def skipped(scenario: str, ctx: Context, check: str, why: str) -> CheckResult:
    return CheckResult(scenario, ctx.model, check, Verdict.SKIP, 0.0, [why])


def earlier_failure(r: RunRecord) -> str | None:
    """The first thing that went wrong in `r` by the connector's doing (its run stopped, or a hook
    raised), or None."""
    if r.error:
        return f"the run stopped: {r.error}"
    return r.failures[0].describe() if r.failures else None


def knock_on(r: RunRecord, what: str) -> str:
    """Evidence that a scenario could not create its case (`what`), said to be a knock-on of the
    earlier failure in `r` that prevented it, when there was one."""
    first = earlier_failure(r)
    return f"knock-on: {what}, because of an earlier failure: {first}" if first else what


def judge_integrity(scenario: str, ctx: Context, runs: list[tuple[RunRecord, list[Req]]]) -> CheckResult:
    evidence = []
    for r, requests in runs:
        if r.error:
            evidence.append(f"the run stopped: {r.error}")
            continue
        found = r.integrity
        evidence += [f"{i.describe()}{source_of(r, i.request_id, i.position)}" for i in found.issues[:5]]
        if found.num_errors and not found.issues:
            evidence.append(f"{found.num_errors} integrity errors")
        evidence += failed_by_connector(r) + late_deliveries_gone_wrong(r) + offers_from_elsewhere(r)
        evidence[:0] = released_page_loads(r)
        expected = reference_tokens(ctx, requests)
        for rid, state in r.outcomes.items():
            if state.phase is Phase.DONE and state.generated_token_ids != expected[rid]:
                evidence.append(f"request {rid}: generated {state.generated_token_ids} but a run without "
                                f"the connector generates {expected[rid]}")
    return result(scenario, ctx, "integrity", not evidence, evidence)


def source_of(r: RunRecord, request_id: int, position: int) -> str:
    """Where the bytes at `position` of `request_id` came from in its last attempt, said after an
    integrity issue: the connector's load (which delivery), the local cache, or the request's own
    computation; nothing for a request never admitted."""
    deliveries = [e for e in r.events.of(Deliver) if e.request_id == request_id]
    if not deliveries:
        return ""
    last = deliveries[-1]        # a paused request is asked again: its pages are those of its last attempt
    first, end = last.num_local_hit, last.num_local_hit + last.num_external
    replayed = f" (attempt {len(deliveries)})" if len(deliveries) > 1 else ""
    if first <= position < end:
        return (f"; this position was loaded by the connector (tokens [{first}, {end}) delivered in iteration "
                f"{last.iteration}{replayed}): its load wrote wrong bytes, or its store held them")
    if position < first:
        return f"; this position came from the local cache{replayed} (pages shared with an earlier request)"
    return f"; this position was computed by the request itself{replayed}: something overwrote its page afterwards"


def late_deliveries_gone_wrong(r: RunRecord) -> list[str]:
    """Requests whose loaded bytes are wrong and whose offer was delivered in a later iteration than
    it was made: said in words, because the usual cause is a connector that forgets its offers at
    every build_connector_meta (under the V2 runtime an offer outlives the iteration it was made in)."""
    asked = {e.request_id: e.iteration for e in r.events.of(Ask)}
    wrong = set(r.integrity.errors_by_request)
    return [f"request {e.request_id}: offer made at iteration {asked[e.request_id]}, delivered at iteration "
            f"{e.iteration}, and the loaded bytes are wrong: the connector dropped the offer before it was "
            "delivered (an offer outlives the iteration it was made in)"
            for e in r.events.of(Deliver)
            if e.request_id in wrong and e.num_external and asked.get(e.request_id, e.iteration) < e.iteration]


def offers_from_elsewhere(r: RunRecord) -> list[str]:
    """Offers of blocks no request of this engine had computed: the store outlived an earlier
    engine, or the index claimed a block nobody stored (`outlived_store` and `cause_evidence`,
    where the words are)."""
    return store_outlived_engine(r)


def failed_by_connector(r: RunRecord) -> list[str]:
    """Requests the connector made fail: nothing they would have produced was proven, so each one
    counts against it. Not counted here: an abort a scenario asked for, and a load that never
    landed (`load-completes` judges that)."""
    return [f"request {rid} failed ({state.error}): a request the connector fails is not served correctly"
            for rid, state in r.outcomes.items() if state.failure not in _NOT_INTEGRITY_FAILURES
            and follower_store_lacks(r, rid) is None]   # that one is said in words (offers_from_elsewhere)


_NOT_INTEGRITY_FAILURES = (None, FailureReason.ABORTED, FailureReason.STUCK_IN_TRANSMISSION)


def judge_warm_hit(scenario: str, ctx: Context, r: RunRecord, warm_ids: list[int]) -> CheckResult:
    """Each of `warm_ids` repeats a prompt the connector saw: it should be served (tokens loaded
    intact: the request did not fail and no byte it loaded was wrong). Serving nothing is a miss,
    not an error (a failure under `--strict`); wrong bytes are the integrity check's."""
    if r.error:
        return result(scenario, ctx, "warm-hit", False, [f"the run stopped: {r.error}"])
    served = {rid: served_intact(r, rid) for rid in warm_ids if rid in r.outcomes or not ctx.cut}   # a cut drops some
    cold = [rid for rid, n in served.items() if n == 0]
    if not cold:
        return result(scenario, ctx, "warm-hit", True,
                      [f"request {rid}: {n} tokens served" for rid, n in served.items()])
    evidence = [_why_not_served(r, rid) for rid in cold]
    check = result(scenario, ctx, "warm-hit", False, evidence)
    return check if ctx.strict else replace(check, verdict=Verdict.MISS)


def served_intact(r: RunRecord, request_id: int) -> int:
    """Tokens the connector loaded for a request that then ran correctly (0 for one that failed
    or read a wrong byte)."""
    state = r.outcome(request_id)
    broken = state.failure is not None or r.integrity.errors_by_request.get(request_id, 0)
    return 0 if broken else state.num_external


def _why_not_served(r: RunRecord, request_id: int) -> str:
    state = r.outcome(request_id)
    if state.num_external == 0:
        return f"request {request_id} repeats a prompt the connector saw, but it offered nothing"
    why = f"it failed ({state.error})" if state.failure is not None else "bytes it loaded were wrong"
    return f"request {request_id}: {state.num_external} tokens offered, none served intact: {why}"


def judge_holds_nothing(scenario: str, ctx: Context, r: RunRecord, followup_ok: bool | None = None) -> CheckResult:
    if r.error:
        return result(scenario, ctx, "holds-nothing", False, [f"the run stopped: {r.error}"])
    if r.introspection is None:
        ok = followup_ok is not False
        return result(scenario, ctx, "holds-nothing", ok,
                      ["no kvtool_introspection hook: judged by a later request on the same prompt, which "
                       + ("was served correctly" if ok else "went wrong")])
    gone = {rid for rid, s in r.outcomes.items() if not s.is_live}
    held = sorted(set(r.introspection.tracked_request_ids or ()) & gone)
    pinned = r.introspection.pinned_entries or 0
    evidence = [f"still tracks finished or cancelled request {rid}" for rid in held]
    if pinned and _held_reservations(r):   # the connector must keep a reservation's source until released
        return result(scenario, ctx, "holds-nothing", not evidence, evidence or [
            f"{pinned} store entries pinned for reservations the runtime still holds (see reservations)"])
    if pinned:
        evidence.append(f"{pinned} store entries still pinned after every request finished")
    return result(scenario, ctx, "holds-nothing", not evidence, evidence or ["nothing held"])


def judge_async(scenario: str, ctx: Context, r: RunRecord) -> list[CheckResult]:
    """load-completes and finished-ids, wherever the connector went asynchronous (or misreported)."""
    out = []
    stuck = [f"request {e.request_id}: {r.outcome(e.request_id).error}" for e in r.events.of(Finished)
             if e.failure is FailureReason.STUCK_IN_TRANSMISSION]
    async_loads = [e for e in r.events.of(LoadStarted) if e.is_async]
    if async_loads or stuck:
        out.append(result(scenario, ctx, "load-completes", not stuck,
                          stuck or [f"{len(async_loads)} asynchronous loads landed"]))
    bad_ids = [v.detail for v in r.violations if v.check.is_bad_finished_id]
    saves = [e.request_id for e in r.events.of(SaveStarted)]
    reported = {e.request_id for e in r.events.of(SaveFinished)}
    unsaved = [_unreported_save(r, rid) for rid in saves if rid not in reported]
    if saves or bad_ids:
        out.append(result(scenario, ctx, "finished-ids", not bad_ids and not unsaved,
                          bad_ids + unsaved or [f"{len(saves)} asynchronous saves reported once each"]))
    return out


def _unreported_save(r: RunRecord, request_id: int) -> str:
    """Why a request's asynchronous save is not done: what the engine's save timeout said when it
    failed the request (`request 3 waits for its asynchronous save, which ... within 5 s`)."""
    state = r.outcome(request_id)
    if state.failure is FailureReason.STUCK_IN_TRANSMISSION and state.error:
        return state.error.removeprefix(f"{FailureReason.STUCK_IN_TRANSMISSION.value}: ")
    return f"request {request_id}: its asynchronous save was never reported"


def judge_reservations(scenario: str, ctx: Context, r: RunRecord) -> list[CheckResult]:
    """`reservations`, wherever the connector took part in prefix reservations: each reservation's
    tokens released exactly once by the end of the run (a load that never retires, because a
    worker never reported it, keeps its reservation: the connector's failure)."""
    promised = {e.reservation_id: e for e in r.events.of(Reserved)}
    if not promised or r.error:
        return []
    released: dict[int, list[tuple[int, int]]] = {}
    for e in r.events.of(ReservationReleased):
        released.setdefault(e.reservation_id, []).append((e.start, e.end))
    retired = {e.reservation_id for e in r.events.of(PrefixLoadRetired)}
    evidence = [_unreleased(e, released.get(rid, []), rid in retired) for rid, e in promised.items()]
    evidence = [line for line in evidence if line]
    return [result(scenario, ctx, "reservations", not evidence,
                   evidence or [f"{len(promised)} reservations, each released once ({len(retired)} loads retired)"])]


def _held_reservations(r: RunRecord) -> bool:
    """Whether some reservation was not wholly released by the end of the run."""
    released: dict[int, int] = {}
    for e in r.events.of(ReservationReleased):
        released[e.reservation_id] = released.get(e.reservation_id, 0) + e.end - e.start
    return any(released.get(e.reservation_id, 0) < e.end - e.start for e in r.events.of(Reserved))


def _unreleased(promise: Reserved, parts: list[tuple[int, int]], retired: bool) -> str:
    """What is wrong with one reservation's releases, or ""."""
    covered = sorted(parts)
    ends = [promise.start]
    for start, end in covered:
        if start != ends[-1]:
            break
        ends.append(end)
    if ends[-1] == promise.end and len(covered) == len(ends) - 1:
        return ""
    where = f"reservation {promise.reservation_id} of request {promise.request_id} [{promise.start}, {promise.end})"
    if sum(e - s for s, e in covered) > promise.end - promise.start:
        return f"{where}: released more than once ({covered})"
    if not retired:
        return (f"{where}: released {covered or 'nothing'}; its confirmed load was never reported by "
                "get_finished_prefix_loads on every worker, so the runtime still holds it")
    return f"{where}: released {covered}, not exactly its tokens"


def judge_answers(scenario: str, ctx: Context, r: RunRecord, always: bool = False) -> list[CheckResult]:
    bad = [f"{v.check}: request {v.request_id}: {v.detail}" for v in r.violations
           if v.check.is_bad_answer]
    if bad or always:
        return [result(scenario, ctx, "answers-in-contract", not bad, bad or ["every answer was in contract"])]
    return []


