"""The pause scenario: TensorRT-LLM's MAX_UTILIZATION policy takes a running request's allocation
back so that another can grow. The connector hears `request_finished` for the paused request
(early: `request.is_finished` is False), the request runs again from the start with its tokens so
far as its context, is asked again, and is reported in `new_requests` with its whole block list.
A connector that keeps the old page indices (they now belong to other requests) saves another
request's KV under this one's keys; later requests repeating these prompts load it.
"""

from __future__ import annotations

from kvtool.engine.runtimes.behaviours import Behaviour
from kvtool.engine.runtimes.names import RuntimeName
from kvtool.validate.harness import Context, Req, Scenario, reference_tokens, run, tokens
from kvtool.validate.interventions import note_pages
from kvtool.validate.judges import judge_integrity, judge_warm_hit, result
from kvtool.validate.results import CheckResult
from kvtool.validate.run_record import RunRecord
from kvtool.validate.schedule import schedule_for
from kvtool.validate.sizing import squeeze_slots

NUM_GROWING = 3
PROMPT_BLOCKS = 3
NEW_BLOCKS = 4


def pause_replay(ctx: Context) -> list[CheckResult]:
    """Three requests that all grow, in a pool holding fewer blocks than they reach together (sized
    from the layout), then, once they are done, the same conversations continued (prompt and
    answer): the paused requests' saves and the replays' saves are what serves them."""
    T = ctx.tokens_per_block
    # the request started last grows longest: it is paused, and the others end soon enough that its
    # replay finds room for the connector's offer, in pages other than it held (`moved_pages` says so)
    growing = [Req(i, tokens(70 + i, PROMPT_BLOCKS * T + 1), max_new_tokens=(NEW_BLOCKS - (i < NUM_GROWING - 1)) * T)
               for i in range(NUM_GROWING)]
    answers = reference_tokens(ctx, growing)
    again = [Req(10 + q.request_id, q.tokens + tuple(answers[q.request_id][:-1]), arrival=5.0 + q.request_id)
             for q in growing]   # one at a time: each finds room for its whole offer
    room = squeeze_slots(ctx, (PROMPT_BLOCKS + NEW_BLOCKS) * NUM_GROWING - NEW_BLOCKS - 1
                         - schedule_for(ctx.seed).pause_room_delta)
    pages: dict[int, list] = {}
    r = run(ctx, growing + again, num_slots=room, pause_to_grow=True, on_iteration=note_pages(pages))
    pauses = {} if r.error else {rid: s.num_pauses for rid, s in r.outcomes.items() if s.num_pauses}
    integrity = judge_integrity("pause-replay", ctx, [(r, growing + again)])
    moved = [] if r.error else moved_pages(r, pages)
    integrity.evidence += moved
    if not r.error and not pauses:
        return [result("pause-replay", ctx, "integrity", False,
                       [f"not exercised: no request was paused with {room} slots per pool group"])]
    if integrity.verdict.value == "pass":
        served = sum(r.outcome(q.request_id).num_external for q in again)
        integrity.evidence = [f"paused: {', '.join(f'request {rid} {n}x' for rid, n in sorted(pauses.items()))}; "
                              f"repeats served {served} tokens"] + moved
    return [integrity, judge_warm_hit("pause-replay", ctx, r, [q.request_id for q in again])]


def moved_pages(r: RunRecord, pages: dict[int, list]) -> list[str]:
    """`exercised: ...` / `not exercised: ...` per paused request: whether its replay ran in other
    pages than its first attempt held, and was loaded by the connector (no local match)."""
    out = []
    for rid, attempts in sorted(pages.items()):
        if len(attempts) < 2:
            continue
        kept = sum(len(a & b) for a, b in zip(attempts[0], attempts[-1], strict=True))
        loaded = r.outcome(rid).num_external
        happened = kept < sum(map(len, attempts[-1])) and loaded > 0 and r.outcome(rid).num_local_hit == 0
        out.append(f"{'exercised' if happened else 'not exercised'}: request {rid}'s replay ran in pages other than "
                   f"its first attempt's ({kept} of them kept) and the connector loaded {loaded} tokens into them")
    return out


PAUSE_SCENARIOS = (
    Scenario("pause-replay", "running requests paused to let others grow (MAX_UTILIZATION), replayed from the "
                             "start with their tokens so far, then their prompts repeated", pause_replay,
             exercises=(Behaviour.ASKED_AGAIN, Behaviour.CAPACITY_POLICY),
             runs_on=frozenset({RuntimeName.TRTLLM_V2, RuntimeName.TRTLLM_V2_RELEASE}),
             not_here="V1 runs a connector only under GUARANTEED_NO_EVICT, which never pauses a request"),
)
