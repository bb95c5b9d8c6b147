"""Prefix reservations (`main`'s V2 with a connector that implements them): a scenario for each row
of TensorRT-LLM's lifecycle table ("Reserving a prefix during admission" in its connector docs):
a candidate rejected, an offer shortened, a cancellation during transmission that keeps the
allocation, a load completed on every rank. Each is judged on the bytes and on every reservation
released exactly once (`judges.judge_reservations`)."""

from __future__ import annotations

from kvtool.connector.api import takes_part_in_reservations
from kvtool.engine.events import Finished, PrefixLoadRetired, ReservationReleased, Reserved
from kvtool.engine.runtimes.behaviours import Behaviour
from kvtool.engine.runtimes.names import RuntimeName
from kvtool.validate.harness import Context, NotRunHere, Req, Scenario, run, tokens
from kvtool.validate.interventions import abort_in_transmission
from kvtool.validate.judges import (
    judge_answers,
    judge_async,
    judge_holds_nothing,
    judge_integrity,
    judge_reservations,
    judge_warm_hit,
)
from kvtool.validate.results import CheckResult
from kvtool.validate.run_record import RunRecord
from kvtool.validate.sizing import squeeze_slots


def _require_reservations(ctx: Context) -> None:
    assert ctx.spec is not None   # a scenario runs a connector
    if not takes_part_in_reservations(ctx.spec.scheduler_class, ctx.spec.worker_class):
        raise NotRunHere("the connector does not take part in prefix reservations (reserve_prefix, "
                         "release_prefix_reservation, get_finished_prefix_loads): main's V2 asks it on the final "
                         "batch instead")


def _judged(name: str, ctx: Context, r: RunRecord, reqs: list[Req], what: str, happened: bool) -> list[CheckResult]:
    integrity = judge_integrity(name, ctx, [(r, reqs)])
    if not r.error:
        integrity.evidence.append(f"{'exercised' if happened else 'not exercised'}: {what}")
    return [integrity, judge_holds_nothing(name, ctx, r)] + judge_reservations(name, ctx, r) + \
        judge_async(name, ctx, r) + judge_answers(name, ctx, r)


def _reservations_of(r: RunRecord, request_id: int) -> list[Reserved]:
    return [e for e in r.events.of(Reserved) if e.request_id == request_id]


def candidate_rejected(ctx: Context) -> list[CheckResult]:
    """Request 1 repeats request 0's prompt while request 9 fills the pool: its reservation is made,
    its first chunk cannot get pages, so the candidate is rejected (released whole) and every later
    attempt reserves anew, under a fresh id, until one is admitted and loads."""
    _require_reservations(ctx)
    T = ctx.tokens_per_block
    prompt = tokens(30, 4 * T + 2)
    reqs = [Req(0, prompt), Req(9, tokens(31, 10 * T), max_new_tokens=1, arrival=1.0), Req(1, prompt, arrival=1.0)]
    r = run(ctx, reqs, num_slots=squeeze_slots(ctx, 14))
    attempts = _reservations_of(r, 1)
    retired = {e.reservation_id for e in r.events.of(PrefixLoadRetired)}
    happened = len(attempts) > 1 and len({e.reservation_id for e in attempts}) == len(attempts) \
        and attempts[0].reservation_id not in retired and r.outcome(1).num_external > 0
    return _judged("prefix-rejected", ctx, r, reqs, f"request 1 reserved {len(attempts)} times, a fresh id each; "
                   "the rejected candidates released whole, the last one loaded", happened)


def offer_shortened(ctx: Context) -> list[CheckResult]:
    """Prompts held whole, one ending on a block boundary and one inside a block, and one with a local
    match inside a block: a promise past the last prompt token or inside a block is cut to whole
    blocks below the last token, and the cut tail released at once."""
    _require_reservations(ctx)
    T = ctx.tokens_per_block
    aligned, ragged = tokens(40, 4 * T), tokens(41, 5 * T + 2)
    reqs = [Req(0, aligned), Req(1, ragged), Req(2, aligned, arrival=1.0), Req(3, ragged, arrival=1.0)]
    r = run(ctx, reqs)
    cut = [e for e in r.events.of(ReservationReleased) if e.request_id in (2, 3)
           and any(p.reservation_id == e.reservation_id and p.start < e.start for p in r.events.of(Reserved))]
    return _judged("prefix-shortened", ctx, r, reqs, "a promise's tail released before its load "
                   f"({len(cut)} cut; a connector that promises whole blocks below the last token is never cut)",
                   bool(cut)) + [judge_warm_hit("prefix-shortened", ctx, r, [2, 3])]


def cancelled_in_flight(ctx: Context) -> list[CheckResult]:
    """Request 1's asynchronous prefix load is in flight when it is aborted: the runtime never aborts
    a transfer, so its allocation stays until every worker reported the load; only then does it end
    and its pages go. Request 2 repeats the prompt afterwards."""
    _require_reservations(ctx)
    T = ctx.tokens_per_block
    prompt = tokens(42, 6 * T + 1)
    reqs = [Req(0, prompt), Req(1, prompt, arrival=1.0), Req(2, prompt, arrival=2.0)]
    r = run(ctx, reqs, on_iteration=abort_in_transmission(1))
    retired = [e.iteration for e in r.events.of(PrefixLoadRetired) if e.request_id == 1]
    ended = [e.iteration for e in r.events.of(Finished) if e.request_id == 1]
    happened = bool(retired and ended) and "aborted" in (r.outcome(1).error or "")
    out = _judged("prefix-cancelled-in-flight", ctx, r, reqs, "request 1 aborted while its prefix load was in "
                  "flight, ended only once the load retired" if happened else
                  "no asynchronous prefix load in flight to abort (the connector loads synchronously)", happened)
    if happened and ended[0] < retired[0]:
        out[0].evidence.insert(0, f"request 1 ended in iteration {ended[0]}, before its prefix load retired in "
                                  f"iteration {retired[0]}: its pages went while the load could still write them")
    return out


def every_rank(ctx: Context) -> list[CheckResult]:
    """With several ranks each worker loads its own shard: a prefix load retires (its reservation is
    released, an asynchronous one's request runs) only once every worker reported it."""
    _require_reservations(ctx)
    if ctx.num_ranks < 2:
        raise NotRunHere("not run with one rank: a load completed on every rank needs --num-ranks 2 or more")
    T = ctx.tokens_per_block
    prompt = tokens(43, 7 * T + 3)
    reqs = [Req(0, prompt), Req(1, prompt, arrival=1.0), Req(2, prompt[:3 * T] + tokens(44, 2 * T), arrival=2.0)]
    r = run(ctx, reqs)
    retired = r.events.of(PrefixLoadRetired)
    return _judged("prefix-every-rank", ctx, r, reqs, f"{len(retired)} prefix loads retired once every one of "
                   f"{ctx.num_ranks} workers reported them", bool(retired)) + \
        [judge_warm_hit("prefix-every-rank", ctx, r, [1, 2])]


_EXERCISES = (Behaviour.PREFIX_RESERVATIONS,)
_ONLY_V2 = frozenset({RuntimeName.TRTLLM_V2})
_NOT_HERE = "prefix reservations exist on main's KVCacheManagerV2 only"

RESERVATION_SCENARIOS = (
    Scenario("prefix-rejected", "a reserved candidate whose first chunk finds no pages: released whole, a fresh "
                                "reservation id at every later attempt", candidate_rejected, exercises=_EXERCISES,
             runs_on=_ONLY_V2, not_here=_NOT_HERE),
    Scenario("prefix-shortened", "promises cut to whole blocks below the last prompt token: the tail released "
                                 "before the load", offer_shortened, exercises=_EXERCISES, runs_on=_ONLY_V2,
             not_here=_NOT_HERE),
    Scenario("prefix-cancelled-in-flight", "a request aborted while its prefix load is in flight keeps its "
                                           "allocation until the load retires", cancelled_in_flight,
             exercises=_EXERCISES, runs_on=_ONLY_V2, not_here=_NOT_HERE),
    Scenario("prefix-every-rank", "a prefix load retires only when every worker reported it (--num-ranks 2+)",
             every_rank, exercises=_EXERCISES, runs_on=_ONLY_V2, not_here=_NOT_HERE),
)
