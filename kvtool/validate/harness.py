"""Running a connector through a workload for a scenario, and judging what happened."""

from __future__ import annotations

import functools
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable

from kvtool.connector.loader import ConnectorSpec
from kvtool.connector.raised import describe_error, format_error, with_wrapped_location
from kvtool.connector.request import Request
from kvtool.engine.engine import Engine, EngineConfig
from kvtool.engine.fake_engine import PassItem
from kvtool.engine.events import Ask, Deliver, EventLog, Finished, LoadStarted, PassDone, SaveFinished, SaveStarted
from kvtool.engine.request_state import FailureReason, Phase
from kvtool.engine.scheduler import SchedulerConfig
from kvtool.errors import ConstructionError, InputError
from kvtool.manager import KvCacheManagerConfig
from kvtool.manager.layer_groups import plan_layer_groups
from kvtool.models import load_model
from kvtool.validate.cause_evidence import note_engine_blocks, released_page_loads
from kvtool.validate.outlived_store import follower_store_lacks, store_outlived_engine
from kvtool.validate.results import CheckResult, Verdict, verdict
from kvtool.validate.schedule import schedule_for, settle
from kvtool.validate.shrink import Cut

CANARY_ID = -424242

MAX_SLOTS = 1024
"""The most slots a pool group of any engine a scenario builds gets (the reference run's cap; the
scenarios' own pools are smaller): what `runner.gpu_jobs_cap` sizes a scenario process by."""


@dataclass(frozen=True)
class Context:
    spec: ConnectorSpec
    model: str
    tokens_per_block: int = 4
    options: tuple[tuple[str, str], ...] = ()
    seed: int = 0
    """Seeds the fingerprints and the schedule (`schedule.schedule_for`)."""
    device: str = "cpu"
    """Where the KV pages live: "cpu", or "cuda" (pages, poisoning, canary and checks on the GPU)."""
    load_timeout: float = 5.0
    """Wall-clock seconds an asynchronous load may take before `load-completes` fails it."""
    compat: str | None = None
    """The `--compat` modules a child process installs before importing the connector."""
    num_ranks: int = 1
    """Ranks 1..num_ranks-1 run as processes, each with its own pools and worker."""
    tp_size: int = 1
    """Tensor-parallel shards (1: every rank holds every head; else num_ranks)."""
    remote: str | None = None
    """The server the connector stores into (redis:// or mooncake://), for the remote scenarios to disrupt."""
    strict: bool = False
    """A miss (served less than it could) fails its check instead of being reported as a miss."""
    draft_tokens: int = 0
    """Draft tokens per decode step (speculative decoding), for the scenarios that set it."""
    save_timeout: float = 5.0
    """Wall-clock seconds an asynchronous save (`request_finished` answered True) may stay unreported
    by `get_finished` before its request fails and `finished-ids` fails with it."""
    cut: Cut | None = None
    """Fewer requests and shorter outputs in every run (`shrink`: --max-requests, --max-new-tokens)."""
    warmup: float = 0.0
    """Seconds every engine waits after the connector's setup before its first pass (`--warmup`)."""


@dataclass(frozen=True)
class Scenario:
    name: str
    purpose: str
    run: Callable[[Context], list[CheckResult]]
    disrupts_remote: bool = False
    """It empties, pauses or disconnects the `--remote` server: given one, it runs with no other
    scenario in flight (`runner.next_task`), since every scenario's store lives on that server."""


@dataclass(frozen=True)
class Req:
    """A request of a scenario's workload (turned into a fresh `Request` for every run)."""

    request_id: int
    tokens: tuple[int, ...]
    max_new_tokens: int = 2
    arrival: float = 0.0
    cache_salt: str | None = None

    def build(self) -> Request:
        return Request(self.request_id, self.tokens, self.max_new_tokens, self.cache_salt, arrival=self.arrival)


def tokens(seed: int, length: int) -> tuple[int, ...]:
    return tuple((seed * 1_000_003 + i * 7919) % 30_011 + 1 for i in range(length))


@dataclass
class Run:
    engine: Engine | None
    error: str | None = None
    canary_issues: int = 0
    notes: list[str] = field(default_factory=list)
    events: EventLog = field(default_factory=EventLog)
    """Everything the engine emitted during the run: what the judges read."""

    @property
    def states(self):
        return self.engine.states if self.engine else {}

    def state(self, request_id: int):
        return self.states[request_id]

    @property
    def runtime(self):
        return self.engine.connector if self.engine else None


def engine_config(ctx: Context, num_slots: int, chunk_size: int | None, local_reuse: bool,
                  max_batch_size: int, pause_to_grow: bool = False, reference: bool = False) -> EngineConfig:
    """Pages poisoned and every live page verified each iteration; loads bounded in wall-clock time;
    slot order and idle polls from the seed's schedule. A `reference` run (no connector) computes
    only its tokens (`tokens` fidelity): nothing moved its pages, so checking them would only test
    kvtool, whose own tests do; those checks were two fifths of validate's time."""
    schedule = schedule_for(ctx.seed)
    manager = KvCacheManagerConfig(load_model(ctx.model), ctx.tokens_per_block, num_slots=num_slots, device=ctx.device,
                                   poison_new_pages=True, keep_reusable_pages=local_reuse,
                                   slot_order=schedule.slot_order, slot_order_seed=ctx.seed)
    scheduler = SchedulerConfig(max_batch_size, 4096, chunk_size, local_reuse, pause_to_grow=pause_to_grow)
    return EngineConfig(manager, scheduler, seed=ctx.seed, draft_tokens=ctx.draft_tokens,
                        verify_all_after_iteration=not reference, fidelity="tokens" if reference else "bytes",
                        max_transmission_seconds=ctx.load_timeout,
                        max_saving_seconds=ctx.save_timeout, gate_async_work=True,
                        idle_wait_seconds=schedule.idle_wait_seconds, warmup_seconds=ctx.warmup,
                        num_ranks=ctx.num_ranks, tp_size=ctx.tp_size, ranks_as_processes=True)


DEFAULT_SLOTS, DEFAULT_BATCH = 256, 64


def run(ctx: Context, requests: list[Req], *, num_slots: int = DEFAULT_SLOTS, chunk_size: int | None = None,
        local_reuse: bool = False, canary: bool = False, max_batch_size: int = DEFAULT_BATCH, connector: bool = True,
        setup: Callable[[Engine], None] | None = None,
        on_iteration: Callable[[Engine], None] | None = None, pause_to_grow: bool = False) -> Run:
    """Replay `requests`; the connector under test is attached unless `connector` is False;
    `pause_to_grow`: TensorRT-LLM's MAX_UTILIZATION (running requests paused to let others grow).
    A run that leaves its shape free (pool, chunks and batch as defaulted) takes the seed's batch
    cap and chunk size; async work is let run where the seed's schedule says (`schedule.settle`)."""
    schedule = schedule_for(ctx.seed)
    requests = ctx.cut.apply(requests) if ctx.cut else requests
    if num_slots == DEFAULT_SLOTS and chunk_size is None and max_batch_size == DEFAULT_BATCH:
        chunk_size, max_batch_size = schedule.chunk_size, schedule.max_batch_size or max_batch_size
    config = engine_config(ctx, num_slots, chunk_size, local_reuse, max_batch_size, pause_to_grow,
                           reference=not connector)
    engine = Engine(config, ctx.spec if connector else None, dict(ctx.options))
    result = Run(engine)
    engine.events.subscribe(result.events)
    check_canary = _plant_canary(engine) if canary else None
    if setup:
        setup(engine)
    for request in requests:
        engine.add_request(request.build())

    def each(e: Engine) -> None:
        if check_canary:
            check_canary()
        if on_iteration:
            on_iteration(e)
        pause = settle(schedule, e.iteration)
        if pause:
            time.sleep(pause)   # the gate is open: the connector's threads run meanwhile

    try:
        # An idle iteration waiting on a load or save sleeps 0.5 ms: allow enough of them for the timeouts.
        engine.run(max_iterations=2000 + int(max(ctx.load_timeout, ctx.save_timeout) * 4000), on_iteration=each)
    except Exception as exc:  # noqa: BLE001 - a scenario that breaks is a finding, not a crash
        result.error = describe_error(exc)
        _note_traceback(f"the run stopped: {result.error}", format_error(exc))
    finally:
        engine.close()
        for failure in engine.connector.failures if engine.connector is not None else ():
            _note_traceback(failure.describe(), failure.traceback)
    if connector:
        note_engine_blocks(engine, computed_blocks(result))
    return result


_TRACEBACKS: list[tuple[str, str]] = []
"""(what failed, its traceback) for every hook failure and stopped run in this process since
`take_tracebacks` was last called: the runner attaches them to the scenario's results."""


def _note_traceback(what: str, text: str) -> None:
    _TRACEBACKS.append((what, text.rstrip("\n") or "(no traceback travelled with it: raised on a follower rank)"))


def take_tracebacks() -> list[str]:
    """Every traceback noted since the last call, once each (identical ones counted), each headed by
    what failed; and forget them."""
    counts = Counter(_TRACEBACKS)
    _TRACEBACKS.clear()
    return [f"{what}{f' ({n} times)' if n > 1 else ''}\n{text}" for (what, text), n in counts.items()]


def _plant_canary(engine: Engine) -> Callable[[], None]:
    """A cache holding the highest slot of every pool group, with known fingerprints, checked after
    every iteration: what a write through page index -1 would hit."""
    manager = engine.manager
    for pg in manager.pool_groups:
        manager.page_table.allocators[pg.pool_group_index].hand_out_last_first(len(pg.layer_group_ids))
    cache = manager.create_kv_cache(CANARY_ID, [])
    cache.resume()
    tpb = manager.tokens_per_block
    cache.resize(tpb)
    canary_tokens = list(tokens(99, tpb))
    pages = cache.page_indices_by_group()
    engine.fake.write_context(PassItem(CANARY_ID, canary_tokens, pages, 0, tpb, False))
    return lambda: engine.fake.verify_cache(CANARY_ID, canary_tokens, pages, tpb)


@functools.lru_cache(maxsize=64)
def _reference(ctx_key: tuple, requests: tuple[Req, ...], chunk_size: int | None) -> dict[int, list[int]]:
    model, tpb, seed, draft_tokens = ctx_key
    ctx = Context(ConnectorSpec("none", object, object, ""), model, tpb, (), seed,   # one rank: digests add up
                  draft_tokens=draft_tokens)
    # room for every request at once (never squeezed), and no more: a block of a real model's layout
    # at a window-sized block size is megabytes
    blocks = sum(-(-(len(q.tokens) + q.max_new_tokens + draft_tokens) // tpb) for q in requests)
    num_slots = min(MAX_SLOTS, len(plan_layer_groups(load_model(model), tpb)) * blocks + 8)   # pages a block takes <= groups
    result = run(ctx, list(requests), num_slots=num_slots, chunk_size=chunk_size, local_reuse=True, connector=False)
    return {rid: s.request.generated_token_ids for rid, s in result.states.items()}


def reference_tokens(ctx: Context, requests: list[Req]) -> dict[int, list[int]]:
    """Tokens a run without connector generates (what a correct connector must reproduce)."""
    cut = ctx.cut.apply(requests) if ctx.cut else requests
    return _reference((ctx.model, ctx.tokens_per_block, ctx.seed, ctx.draft_tokens), tuple(cut), None)


# ---- judging -----------------------------------------------------------------------------------
def result(scenario: str, ctx: Context, check: str, ok: bool, evidence: list[str]) -> CheckResult:
    return CheckResult(scenario, ctx.model, check, verdict(ok), 0.0, evidence if not ok else evidence[:3])


def skipped(scenario: str, ctx: Context, check: str, why: str) -> CheckResult:
    return CheckResult(scenario, ctx.model, check, Verdict.SKIP, 0.0, [why])


def earlier_failure(r: Run) -> str | None:
    """The first thing that went wrong in `r` by the connector's doing (its run stopped, or a hook
    raised), or None."""
    if r.error:
        return f"the run stopped: {r.error}"
    runtime = r.runtime
    return runtime.failures[0].describe() if runtime is not None and runtime.failures else None


def knock_on(r: Run, what: str) -> str:
    """Evidence that a scenario could not create its case (`what`), said to be a knock-on of the
    earlier failure in `r` that prevented it, when there was one."""
    first = earlier_failure(r)
    return f"knock-on: {what}, because of an earlier failure: {first}" if first else what


def judge_integrity(scenario: str, ctx: Context, runs: list[tuple[Run, list[Req]]]) -> CheckResult:
    evidence = []
    for r, requests in runs:
        if r.error:
            evidence.append(f"the run stopped: {r.error}")
            continue
        engine = r.engine
        evidence += [f"{i.describe()}{source_of(r, i.request_id, i.position)}" for i in engine.fake.issues[:5]]
        if engine.integrity_errors and not engine.fake.issues:
            evidence.append(f"{engine.integrity_errors} integrity errors")
        evidence += failed_by_connector(r) + late_deliveries_gone_wrong(r) + offers_from_elsewhere(r)
        evidence[:0] = released_page_loads(r)
        expected = reference_tokens(ctx, requests)
        for rid, state in r.states.items():
            if state.phase is Phase.DONE and state.request.generated_token_ids != expected[rid]:
                evidence.append(f"request {rid}: generated {state.request.generated_token_ids} but a run without "
                                f"the connector generates {expected[rid]}")
    return result(scenario, ctx, "integrity", not evidence, evidence)


def source_of(r: Run, request_id: int, position: int) -> str:
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


def late_deliveries_gone_wrong(r: Run) -> list[str]:
    """Requests whose loaded bytes are wrong and whose offer was delivered in a later iteration than
    it was made: said in words, because the usual cause is a connector that forgets its offers at
    every build_connector_meta (under the V2 runtime an offer outlives the iteration it was made in)."""
    asked = {e.request_id: e.iteration for e in r.events.of(Ask)}
    wrong = set(r.engine.fake.errors_by_request)
    return [f"request {e.request_id}: offer made at iteration {asked[e.request_id]}, delivered at iteration "
            f"{e.iteration}, and the loaded bytes are wrong: the connector dropped the offer before it was "
            "delivered (an offer outlives the iteration it was made in)"
            for e in r.events.of(Deliver)
            if e.request_id in wrong and e.num_external and asked.get(e.request_id, e.iteration) < e.iteration]


def offers_from_elsewhere(r: Run) -> list[str]:
    """Offers of blocks no request of this engine had computed: the store outlived an earlier
    engine, or the index claimed a block nobody stored (`outlived_store` and `cause_evidence`,
    where the words are)."""
    return store_outlived_engine(r)


def computed_blocks(r: Run) -> set[tuple[int, ...]]:
    """The tokens of every full block a request of `r` computed."""
    tpb = r.engine.manager.tokens_per_block
    blocks: set[tuple[int, ...]] = set()
    for event in r.events.of(PassDone):
        for rid, _, end in event.items:
            if rid in r.states:
                tokens_so_far = r.states[rid].request.get_tokens()
                blocks.update(tuple(tokens_so_far[j * tpb:(j + 1) * tpb]) for j in range(end // tpb))
    return blocks


def failed_by_connector(r: Run) -> list[str]:
    """Requests the connector made fail: nothing they would have produced was proven, so each one
    counts against it. Not counted here: an abort a scenario asked for, and a load that never
    landed (`load-completes` judges that)."""
    return [f"request {rid} failed ({state.error}): a request the connector fails is not served correctly"
            for rid, state in r.states.items() if state.failure not in _NOT_INTEGRITY_FAILURES
            and follower_store_lacks(r, rid) is None]   # that one is said in words (offers_from_elsewhere)


_NOT_INTEGRITY_FAILURES = (None, FailureReason.ABORTED, FailureReason.STUCK_IN_TRANSMISSION)


def judge_warm_hit(scenario: str, ctx: Context, r: Run, warm_ids: list[int]) -> CheckResult:
    """Each of `warm_ids` repeats a prompt the connector saw: it should be served (tokens loaded
    intact: the request did not fail and no byte it loaded was wrong). Serving nothing is a miss,
    not an error (a failure under `--strict`); wrong bytes are the integrity check's."""
    if r.error:
        return result(scenario, ctx, "warm-hit", False, [f"the run stopped: {r.error}"])
    served = {rid: served_intact(r, rid) for rid in warm_ids if rid in r.states or not ctx.cut}   # a cut drops some
    cold = [rid for rid, n in served.items() if n == 0]
    if not cold:
        return result(scenario, ctx, "warm-hit", True, [f"request {rid}: {n} tokens served" for rid, n in served.items()])
    evidence = [_why_not_served(r, rid) for rid in cold]
    check = result(scenario, ctx, "warm-hit", False, evidence)
    return check if ctx.strict else replace(check, verdict=Verdict.MISS)


def served_intact(r: Run, request_id: int) -> int:
    """Tokens the connector loaded for a request that then ran correctly (0 for one that failed
    or read a wrong byte)."""
    state = r.state(request_id)
    broken = state.failure is not None or getattr(r.engine.fake, "errors_by_request", {}).get(request_id, 0)
    return 0 if broken else state.num_external


def _why_not_served(r: Run, request_id: int) -> str:
    state = r.state(request_id)
    if state.num_external == 0:
        return f"request {request_id} repeats a prompt the connector saw, but it offered nothing"
    why = f"it failed ({state.error})" if state.failure is not None else "bytes it loaded were wrong"
    return f"request {request_id}: {state.num_external} tokens offered, none served intact: {why}"


def judge_holds_nothing(scenario: str, ctx: Context, r: Run, followup_ok: bool | None = None) -> CheckResult:
    if r.error:
        return result(scenario, ctx, "holds-nothing", False, [f"the run stopped: {r.error}"])
    introspect = getattr(r.runtime.scheduler, "kvtool_introspect", None)
    if not callable(introspect):
        ok = followup_ok is not False
        return result(scenario, ctx, "holds-nothing", ok,
                      ["no kvtool_introspect hook: judged by a later request on the same prompt, which "
                       + ("was served correctly" if ok else "went wrong")])
    state = introspect()
    gone = {rid for rid, s in r.states.items() if not s.is_live}
    held = sorted(set(state.get("tracked_request_ids", [])) & gone)
    pinned = state.get("pinned_entries", 0)
    evidence = [f"still tracks finished or cancelled request {rid}" for rid in held]
    if pinned:
        evidence.append(f"{pinned} store entries still pinned after every request finished")
    return result(scenario, ctx, "holds-nothing", not evidence, evidence or ["nothing held"])


def judge_async(scenario: str, ctx: Context, r: Run) -> list[CheckResult]:
    """load-completes and finished-ids, wherever the connector went asynchronous (or misreported)."""
    if r.engine is None:
        return []
    runtime, out = r.runtime, []
    stuck = [f"request {e.request_id}: {r.state(e.request_id).error}" for e in r.events.of(Finished)
             if e.failure is FailureReason.STUCK_IN_TRANSMISSION]
    async_loads = [e for e in r.events.of(LoadStarted) if e.is_async]
    if async_loads or stuck:
        out.append(result(scenario, ctx, "load-completes", not stuck,
                          stuck or [f"{len(async_loads)} asynchronous loads landed"]))
    bad_ids = [v.detail for v in runtime.violations if v.check.is_bad_finished_id]
    saves = [e.request_id for e in r.events.of(SaveStarted)]
    reported = {e.request_id for e in r.events.of(SaveFinished)}
    unsaved = [_unreported_save(r, rid) for rid in saves if rid not in reported]
    if saves or bad_ids:
        out.append(result(scenario, ctx, "finished-ids", not bad_ids and not unsaved,
                          bad_ids + unsaved or [f"{len(saves)} asynchronous saves reported once each"]))
    return out


def _unreported_save(r: Run, request_id: int) -> str:
    """Why a request's asynchronous save is not done: what the engine's save timeout said when it
    failed the request (`request 3 waits for its asynchronous save, which ... within 5 s`)."""
    state = r.state(request_id)
    if state.failure is FailureReason.STUCK_IN_TRANSMISSION and state.error:
        return state.error.removeprefix(f"{FailureReason.STUCK_IN_TRANSMISSION.value}: ")
    return f"request {request_id}: its asynchronous save was never reported"


def judge_answers(scenario: str, ctx: Context, r: Run, always: bool = False) -> list[CheckResult]:
    if r.engine is None:
        return []
    bad = [f"{v.check}: request {v.request_id}: {v.detail}" for v in r.runtime.violations
           if v.check.is_bad_answer]
    if bad or always:
        return [result(scenario, ctx, "answers-in-contract", not bad, bad or ["every answer was in contract"])]
    return []


def registration_error(ctx: Context) -> str | None:
    """The registration failure for this model, if the connector cannot take its layout.
    A connector that cannot even be constructed raises ConstructionError (a usage error)."""
    try:
        Engine(engine_config(ctx, 8, None, False, 8), ctx.spec, dict(ctx.options)).close()
    except ConstructionError:
        raise
    except InputError as exc:
        return with_wrapped_location(exc)
    return None
