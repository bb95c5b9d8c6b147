"""Running a connector through a workload for a scenario: the engine, set up and run, and the
`RunRecord` it leaves for the judges (`judges`, the scenario modules)."""

from __future__ import annotations

import functools
import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from kvtool.connector.loader import ConnectorSpec
from kvtool.connector.raised import describe_error, format_error, with_wrapped_location
from kvtool.connector.request import Request
from kvtool.engine.engine import Engine, EngineConfig
from kvtool.engine.events import EventLog
from kvtool.engine.pass_types import PassItem
from kvtool.engine.runtimes import DEFAULT_RUNTIME, RuntimeName, profile_of
from kvtool.engine.runtimes.behaviours import Behaviour
from kvtool.engine.scheduler import SchedulerConfig
from kvtool.errors import ConstructionError, InputError, RefusedSetupError
from kvtool.manager import KvCacheManagerConfig
from kvtool.manager.layer_groups import plan_layer_groups
from kvtool.models import load_model
from kvtool.types import Fidelity
from kvtool.validate.cause_evidence import computed_blocks, note_engine_blocks
from kvtool.validate.results import CheckResult
from kvtool.validate.run_record import RunRecord, record_run
from kvtool.validate.schedule import schedule_for
from kvtool.validate.shrink import Cut

CANARY_ID = -424242

MAX_SLOTS = 1024
"""The most slots a pool group of any engine a scenario builds gets (the reference run's cap; the
scenarios' own pools are smaller): what `runner.gpu_jobs_cap` sizes a scenario process by."""


@dataclass(frozen=True)
class Context:
    spec: ConnectorSpec | None
    """None only in the preflight's probe, whose child process finds the connector itself."""
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
    runtime: RuntimeName = DEFAULT_RUNTIME
    """The TensorRT-LLM runtime every engine of the scenario plays (`kvtool.engine.runtimes`)."""
    runtime_chosen: bool = False
    """The runtime was asked for (`--runtime`): a connector that cannot take part in it fails its
    registration there, instead of the runtime being skipped."""


@dataclass(frozen=True)
class Scenario:
    name: str
    purpose: str
    run: Callable[[Context], list[CheckResult]]
    disrupts_remote: bool = False
    """It empties, pauses or disconnects the `--remote` server: given one, it runs with no other
    scenario in flight (`runner.next_task`), since every scenario's store lives on that server."""
    exercises: tuple[Behaviour, ...] = ()
    """The runtime behaviours its case turns on (`runtimes.behaviours`): where it fails under one
    runtime and passes under another, the rows in which they differ are its evidence."""
    runs_on: frozenset[RuntimeName] = frozenset(RuntimeName)
    not_here: str = ""
    """Why the scenario's case cannot happen under the runtimes outside `runs_on` (its SKIP's evidence)."""


class NotRunHere(Exception):
    """The runtime refuses the setup a scenario needs (TensorRT-LLM's bring-up checks, or the case
    cannot happen there): the scenario is skipped, saying why."""


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


_RUN_IDS = itertools.count(1)


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
    scheduler = SchedulerConfig(max_batch_size, 4096, chunk_size, local_reuse,
                                reserve_outputs=profile_of(ctx.runtime).reserves_outputs and not reference,
                                pause_to_grow=pause_to_grow)
    return EngineConfig(manager, scheduler, seed=ctx.seed, draft_tokens=ctx.draft_tokens,
                        runtime=RuntimeName(ctx.runtime) if not reference else DEFAULT_RUNTIME,
                        verify_all_after_iteration=not reference,
                        fidelity=Fidelity.TOKENS if reference else Fidelity.BYTES,
                        max_transmission_seconds=ctx.load_timeout,
                        max_saving_seconds=ctx.save_timeout, gate_async_work=True, hold_policy=schedule.hold_policy,
                        stream_races=not reference,
                        idle_wait_seconds=schedule.idle_wait_seconds, warmup_seconds=ctx.warmup,
                        num_ranks=ctx.num_ranks, tp_size=ctx.tp_size, ranks_as_processes=True)


DEFAULT_SLOTS, DEFAULT_BATCH = 256, 64


def run(ctx: Context, requests: list[Req], *, num_slots: int = DEFAULT_SLOTS, chunk_size: int | None = None,
        local_reuse: bool = False, canary: bool = False, max_batch_size: int = DEFAULT_BATCH, connector: bool = True,
        setup: Callable[[Engine], None] | None = None,
        on_iteration: Callable[[Engine], None] | None = None, pause_to_grow: bool = False) -> RunRecord:
    """Replay `requests`; the connector under test is attached unless `connector` is False;
    `pause_to_grow`: TensorRT-LLM's MAX_UTILIZATION (running requests paused to let others grow).
    A run that leaves its shape free (pool, chunks and batch as defaulted) takes the seed's batch
    cap and chunk size; background work runs where the seed's schedule says (`engine.hold_policy`).
    `setup` and `on_iteration` are the scenario's hands on the engine (`interventions`); what the
    judges get is the record, filled once the engine has closed."""
    schedule = schedule_for(ctx.seed)
    requests = ctx.cut.apply(requests) if ctx.cut else requests
    if num_slots == DEFAULT_SLOTS and chunk_size is None and max_batch_size == DEFAULT_BATCH:
        chunk_size, max_batch_size = schedule.chunk_size, schedule.max_batch_size or max_batch_size
    config = engine_config(ctx, num_slots, chunk_size, local_reuse, max_batch_size, pause_to_grow,
                           reference=not connector)
    try:
        engine = Engine(config, ctx.spec if connector else None, dict(ctx.options))
    except RefusedSetupError as exc:
        if exc.blames_connector:
            raise
        raise NotRunHere(str(exc)) from None
    events = EventLog()
    engine.events.subscribe(events)
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

    error = None
    try:
        # An idle iteration waiting on a load or save sleeps 0.5 ms: allow enough of them for the timeouts.
        engine.run(max_iterations=2000 + int(max(ctx.load_timeout, ctx.save_timeout) * 4000), on_iteration=each)
    except Exception as exc:  # noqa: BLE001 - a scenario that breaks is a finding, not a crash
        error = describe_error(exc)
        _note_traceback(f"the run stopped: {error}", format_error(exc))
    finally:
        engine.close()
        for failure in engine.connector.failures if engine.connector is not None else ():
            _note_traceback(failure.describe(), failure.traceback)
    record = record_run(engine, events, error, next(_RUN_IDS))
    if connector:
        note_engine_blocks(record.run_id, computed_blocks(record))
    return record


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
    # pages a block takes <= groups
    num_slots = min(MAX_SLOTS, len(plan_layer_groups(load_model(model), tpb)) * blocks + 8)
    result = run(ctx, list(requests), num_slots=num_slots, chunk_size=chunk_size, local_reuse=True, connector=False)
    return {rid: s.generated_token_ids for rid, s in result.outcomes.items()}


def reference_tokens(ctx: Context, requests: list[Req]) -> dict[int, list[int]]:
    """Tokens a run without connector generates (what a correct connector must reproduce)."""
    cut = ctx.cut.apply(requests) if ctx.cut else requests
    return _reference((ctx.model, ctx.tokens_per_block, ctx.seed, ctx.draft_tokens), tuple(cut), None)


def registration_error(ctx: Context) -> str | None:
    """The registration failure for this model, if the connector cannot take its layout (or the
    runtime refuses the connector's classes). A connector that cannot even be constructed raises
    ConstructionError (a usage error); a runtime that refuses the model or configuration raises
    NotRunHere."""
    try:
        Engine(engine_config(ctx, 8, None, False, 8), ctx.spec, dict(ctx.options)).close()
    except ConstructionError:
        raise
    except RefusedSetupError as exc:
        if not exc.blames_connector:
            raise NotRunHere(str(exc)) from None
        return str(exc)
    except InputError as exc:
        return with_wrapped_location(exc)
    return None
