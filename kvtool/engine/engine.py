"""The engine loop: schedule -> deliver -> build_connector_meta -> start_load_kv -> per layer
(wait_for_layer_load, fake forward, save_kv_layer) -> the workers' forward-pass callables ->
wait_for_save -> get_finished -> commit ->
generation steps until max_new_tokens, then request_finished with the request's page indices.
"""

from __future__ import annotations

import time
from bisect import insort
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Iterator


from kvtool.connector.llm_args import LlmArgs
from kvtool.connector.loader import ConnectorSpec
from kvtool.connector.options import check_options, declared_options
from kvtool.connector.request import Request, max_kv_tokens
from kvtool.connector.raised import describe_construction_error, describe_error, stops_kvtool
from kvtool.connector.rank_context import acting_as, set_process_rank
from kvtool.connector.runtime import ConnectorRuntime, HookFailure, require_gpu_tier_only, require_grouped_hooks
from kvtool.engine.async_gate import AsyncGate
from kvtool.engine.events import (Arrived, EngineEvent, EventStream, Evicted, Finished, LoadFinished, PassDone, Paused,
                                  SaveFinished, SaveStarted)
from kvtool.engine.drafts import DraftModel
from kvtool.engine.fake_engine import CHECKSUM_MASK, FakeEngine, PassItem
from kvtool.engine.no_bytes import NoBytesModel
from kvtool.engine.pass_driver import PassDriver, PassPlan, RankWorker, ask_end_of_pass
from kvtool.engine.worker_setup import forward_stream, rank_llm_args, register_worker
from kvtool.engine.ranks import (FinishedOrder, Followers, PassOrder, RankReport, RankSetup,
                                 rank_manager_config)
from kvtool.engine.request_state import FailureReason, Phase, RequestState
from kvtool.engine.scheduler import Batch, Scheduler, SchedulerConfig
from kvtool.engine.scheduler_output import build_scheduler_output
from kvtool.engine.token_model import ReferenceTokens
from kvtool.errors import ConnectorError, ConstructionError, InputError, IterationLimitError, OutOfPagesError
from kvtool.group_pages import GroupPages
from kvtool.manager.config import KvCacheManagerConfig
from kvtool.manager.integrity import check_manager
from kvtool.manager.manager import KvCacheManager, PageHold
from kvtool.manager.pool_groups import pages_per_pool_group
from kvtool.models import heads_across_ranks
from kvtool.types import KvCacheStatus


@dataclass(frozen=True)
class EngineConfig:
    manager: KvCacheManagerConfig
    scheduler: SchedulerConfig = SchedulerConfig()
    seed: int = 0
    num_ranks: int = 1
    verify_all_after_iteration: bool = False
    max_transmission_iterations: int = 64
    max_transmission_seconds: float | None = None
    """When set, an asynchronous load fails after this many wall-clock seconds in transmission
    (instead of after `max_transmission_iterations` iterations: idle iterations take well under a
    millisecond, so counting them judges a slow store unfairly)."""
    max_saving_seconds: float | None = None
    """When set, a finished request whose asynchronous save (`request_finished` answered True)
    `get_finished` has not reported this many wall-clock seconds after it began fails, and its held
    pages are released (None: it holds them until the run ends)."""
    pad_generation_batch_to: int = 0
    """Pad generation batches with dummy requests up to this size (as CUDA-graph padding does)."""
    iteration_seconds: float = 0.01
    check_integrity_every_iteration: bool = False
    tp_size: int = 1
    """Tensor-parallel ranks: each rank's pools hold 1/tp_size of the KV heads (1: every rank
    holds them all)."""
    ranks_as_processes: bool = False
    """Ranks 1..num_ranks-1 run as processes in a torch.distributed group (see `ranks`); False:
    every rank's worker lives in this process and sees rank 0's pages."""
    process_group_of_one: bool = False
    """With one rank and `ranks_as_processes`, still form the torch.distributed group (of one) and
    run every collective: the NCCL path on a machine with one GPU."""
    rank_timeout_s: float = 60.0
    """How long a collective waits for a rank before the run ends naming it."""
    fidelity: str = "bytes"
    """`bytes`: pools hold KV bytes the fake engine writes and verifies; `blocks`: virtual pools,
    nothing written or verified (see `no_bytes`), for a connector that moves no bytes; `tokens`:
    the tokens `bytes` would generate, nothing written or verified (`token_model`), for a run
    with no connector (a reference)."""
    forget_finished: bool = False
    """Drop a request's state once it is over (a long streamed replay); `states` then holds the
    live ones only."""
    iteration_time: Callable[[Batch, list[PassItem]], float] | None = None
    """Simulated seconds one iteration takes (a cost model); None: `iteration_seconds` each."""
    draft_tokens: int = 0
    """Draft tokens per generation step (speculative decoding; `kvtool.engine.drafts`); 0: off."""
    acceptance: float = 0.7
    """With drafts: the probability a draft is accepted, given the ones before it were."""
    gate_async_work: bool = False
    """The connector's threads wait from a pass's first save hook until the reports of that
    iteration's `get_finished` are acted on (`async_gate`): kvtool validate's deterministic race."""
    idle_wait_seconds: float = 0.0005
    """How long an iteration in which nothing ran waits for the connector's background work
    before `get_finished` is polled again."""
    warmup_seconds: float = 0.0
    """Wall-clock seconds between the connector's `wait_for_initialization` and the first pass,
    as TensorRT-LLM's executor warms up (a dummy pass, CUDA graph capture) before it serves: a
    connector that finishes its own setup in the background after registration (KVBM 1.6.1's
    leader builds its slot manager about 50 ms later, and panics on an ask before) is ready only
    with some. 0: the first request is asked at once, which finds such a race."""


@dataclass
class EngineStats:
    iterations: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    num_failed: int = 0
    num_finished: int = 0
    """Requests over (done or failed)."""
    num_deferrals: int = 0
    num_pauses: int = 0
    recomputed_tokens: int = 0
    """Tokens computed again after a pause (computed before it, neither reused nor loaded)."""
    failures: list[str] = field(default_factory=list)


class Engine:
    def __init__(self, config: EngineConfig, connector: ConnectorSpec | None = None,
                 connector_options: dict[str, str] | None = None) -> None:
        if connector is not None:
            require_gpu_tier_only(config.manager.host_cache_bytes, config.manager.disk_cache_bytes)
        self.config = config
        if config.tp_size != 1 and (not config.ranks_as_processes or config.tp_size != config.num_ranks):
            raise InputError(f"--tp {config.tp_size} needs --num-ranks {config.tp_size} (one process per shard)")
        _require_fidelity(config, connector)
        manager_config = rank_manager_config(config.manager, config.tp_size, 0)
        if config.fidelity == "blocks":
            manager_config = replace(manager_config, virtual=True, poison_new_pages=False)
        self.manager = KvCacheManager(manager_config)
        self.fake = _bytes_model(config.fidelity, self.manager, config.seed, heads_across_ranks(manager_config.model))
        self.stats = EngineStats()
        self.states: dict[int, RequestState] = {}
        self._waiting: dict[int, RequestState] = {}
        """Live requests not yet admitted, in arrival order (WAITING is only ever a request's first
        phase). A long replay's queue holds thousands: an iteration looks at no more of them than
        the scheduler takes, so its cost does not grow with the queue."""
        self._started: list[RequestState] = []
        """The other live requests, in arrival order (as many as the pool holds)."""
        self._num_added = 0
        self.clock = 0.0
        self.iteration = 0
        self.events = EventStream()
        self._failed_saves: dict[int, PageHold] = {}
        """Pages of failed or paused requests whose asynchronous save is still in flight."""
        self.manager.page_table.on_evict = self._on_evict
        self._received: list[PassItem] = []
        self._forgotten: list[int] = []
        self.followers = self._start_followers(connector, connector_options or {})
        self.stream = forward_stream(self.manager.device)
        set_process_rank(0, config.num_ranks)
        self.gate = AsyncGate() if config.gate_async_work and connector else None
        self.driver = PassDriver([], self.fake.layer_ids, self.fake.forward_layer, self.stream, self._guarded,
                                 on_hook=self.gate.before_hook if self.gate is not None else lambda hook: None)
        if self.gate is not None:
            self.gate.install()
        try:
            self.connector = self._attach(connector, connector_options or {}) if connector else None
        except Exception:
            self.close()
            raise
        if self.gate is not None:
            self.connector.around_hook = self.gate.hook
        self.drafts = DraftModel(config.draft_tokens, config.acceptance, config.seed) if config.draft_tokens else None
        self.scheduler = Scheduler(self.manager, config.scheduler, self.connector, self.fail, self.emit, self.pause,
                                   self.drafts)
        self._rewinds: dict[int, int] = {}

    # ---- setup -------------------------------------------------------------------------------
    def llm_args(self, spec: ConnectorSpec, options: dict[str, str], rank: int) -> LlmArgs:
        return rank_llm_args(self.manager, spec, options, rank, self.config.num_ranks, self.config.tp_size)

    def _start_followers(self, spec: ConnectorSpec | None, options: dict[str, str]) -> Followers | None:
        config = self.config
        if not config.ranks_as_processes or (config.num_ranks == 1 and not config.process_group_of_one):
            return None
        self.manager.page_log = []
        return Followers(RankSetup(config.manager, tuple(self.manager.num_slots), config.tp_size, config.num_ranks,
                                   config.seed, spec, tuple(options.items()), 0, config.rank_timeout_s,
                                   self.manager.device.type))

    def close(self) -> None:
        """Stop the follower ranks, if any, and the async gate (idempotent)."""
        if self.gate is not None:
            self.gate.uninstall()
        if self.followers is not None:
            self.followers.close()

    def _attach(self, spec: ConnectorSpec, options: dict[str, str]) -> ConnectorRuntime:
        """Construct the scheduler (rank 0) and this process's workers, register the layout, ask
        each worker for its forward-pass callable, then `wait_for_initialization`."""
        declared = declared_options(spec.scheduler_class)
        if declared is not None:
            check_options(spec.name, declared, options)
        try:
            require_grouped_hooks(spec.scheduler_class, len(self.manager.layer_groups))
        except ConnectorError as exc:
            raise InputError(f"connector {spec.name!r}: {exc}") from None
        building = spec.scheduler_class
        try:
            scheduler = building(self.llm_args(spec, options, 0))
            building, workers = spec.worker_class, []
            for rank in range(self._num_local_ranks):
                with acting_as(rank):
                    workers.append(building(self.llm_args(spec, options, rank)))
        except InputError as exc:
            raise ConstructionError(f"connector {spec.name!r} could not be constructed: {exc}") from None
        except BaseException as exc:  # noqa: BLE001 - a constructor failure is the connector's (native panics too)
            if stops_kvtool(exc):
                raise
            raise ConstructionError(f"connector {spec.name!r} could not be constructed: "
                                    f"{describe_construction_error(exc, building)}") from None
        rank_workers = [self._registered(spec, rank, worker) for rank, worker in enumerate(workers)]
        self.driver.workers = rank_workers
        runtime = ConnectorRuntime(scheduler, workers, self.config.num_ranks)
        ok, _ = runtime.call("wait_for_initialization", scheduler.wait_for_initialization)
        if not ok:
            raise InputError(f"connector {spec.name!r}: {runtime.failures[-1].describe()}")
        if self.config.warmup_seconds > 0:
            time.sleep(self.config.warmup_seconds)
        return runtime

    def _registered(self, spec: ConnectorSpec, rank: int, worker) -> RankWorker:
        """`worker` with the layout registered and its forward-pass callable asked (InputError
        naming the connector when either fails)."""
        try:
            with acting_as(rank):
                register_worker(worker, self.manager)
            return RankWorker(rank, worker, ask_end_of_pass(worker, rank))
        except ConnectorError as exc:
            raise InputError(f"connector {spec.name!r}: {exc}") from None
        except BaseException as exc:  # noqa: BLE001 - native panics too
            if stops_kvtool(exc):
                raise
            raise InputError(f"connector {spec.name!r}: registering the KV cache failed: {describe_error(exc)}") from None

    @property
    def _num_local_ranks(self) -> int:
        return 1 if self.followers is not None else self.config.num_ranks

    # ---- events ------------------------------------------------------------------------------
    def emit(self, kind: type[EngineEvent], **fields) -> None:
        """Send one event, stamped with this iteration and clock, to every subscriber of `events`."""
        if self.events.wants(kind):
            self.events.emit(kind(iteration=self.iteration, clock=self.clock, **fields))

    def _on_evict(self, page, block_ordinal: int) -> None:
        self.emit(Evicted, layer_group_id=int(page.layer_group_id), block_ordinal=block_ordinal)

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, request: Request) -> RequestState:
        if request.request_id in self.states:
            raise InputError(f"request id {request.request_id} is used twice")
        self._require_room_for(request)
        state = RequestState(request, arrival_order=self._num_added)
        self._num_added += 1
        self.states[request.request_id] = state
        self._waiting[request.request_id] = state
        self.emit(Arrived, request_id=request.request_id, prompt_len=request.prompt_len, arrival=request.arrival)
        return state

    def _require_room_for(self, request: Request) -> None:
        """InputError now for a request that could not fit even in an empty cache (it would wait forever)."""
        tokens = max_kv_tokens(request.prompt_len, request.max_new_tokens)
        manager = self.manager
        needs = pages_per_pool_group(manager.layer_groups, manager.pool_groups, tokens, manager.tokens_per_block)
        for pg, need in zip(manager.pool_groups, needs):
            have = manager.num_slots[pg.pool_group_index]
            if need > have:
                raise InputError(f"the KV cache is too small: request {request.request_id} ({request.prompt_len} prompt "
                                 f"+ {request.max_new_tokens} new tokens) needs {need} pages in pool group "
                                 f"{pg.pool_group_index}, which has {have}")

    def abort(self, request_id: int) -> None:
        """Free a request wherever it is (before delivery, its whole offer is cancelled)."""
        state = self.states[request_id]
        if state.is_live:
            self.fail(state, FailureReason.ABORTED)

    def pause(self, state: RequestState) -> None:
        """TensorRT-LLM's destructive pause (MAX_UTILIZATION): the connector hears
        `request_finished` (a pause by preemption calls it, not `request_reset`; an asynchronous
        save keeps the pages until reported), the allocation is released (its committed blocks
        stay in the radix tree, so the replay may hit them locally), and the request waits to run
        again from the start, asked anew and reported as new."""
        kv, request_id = state.kv, state.request_id
        num_computed = kv.history_length
        if self.connector is not None and state.seen_by_connector:
            ok, is_async = self.connector.finish(state.request, kv.page_indices_by_group())
            if not ok:
                self.fail(state, FailureReason.FINISHED_HOOK_RAISED)
                return
            if is_async:
                self._failed_saves[request_id] = self.manager.hold_pages(kv)
        kv.close()
        state.pause(num_computed)
        state.paused_at = self.iteration
        self._forget(request_id)
        self._started = [s for s in self._started if s is not state]
        self._waiting = dict(sorted([*self._waiting.items(), (request_id, state)], key=lambda kv_: kv_[1].arrival_order))
        self.stats.num_pauses += 1
        self.emit(Paused, request_id=request_id, num_computed_tokens=num_computed, context_len=state.prompt_len)

    @property
    def live_states(self) -> list[RequestState]:
        """Every request not over yet, in arrival order."""
        return sorted([*self._started, *self._waiting.values()], key=_arrival_order)

    def is_done(self) -> bool:
        return not self._waiting and not self._started

    # ---- the loop ----------------------------------------------------------------------------
    def run(self, max_iterations: int = 100_000, on_iteration=None) -> EngineStats:
        """Run the requests added so far until every one has finished."""
        return self.run_stream((), max_iterations, on_iteration)

    def run_stream(self, requests: Iterable[Request], max_iterations: int = 10_000_000, on_iteration=None) -> EngineStats:
        """Run requests read one at a time: each is added when the clock reaches its arrival
        (arrivals must not decrease), so only the requests in flight are in memory."""
        upcoming = _Lookahead(iter(requests))
        while upcoming.peek() is not None or not self.is_done():
            if self.is_done() and upcoming.peek().arrival > self.clock:
                self.clock = upcoming.peek().arrival
            while upcoming.peek() is not None and upcoming.peek().arrival <= self.clock:
                self.add_request(upcoming.take())
            if self.iteration >= max_iterations:
                raise IterationLimitError(f"{len(self.live_states)} requests still unfinished after "
                                          f"{max_iterations} iterations: {self._stuck_description()}")
            self.step()
            if on_iteration is not None:
                on_iteration(self)
        return self.stats

    def _stuck_description(self) -> str:
        """What the unfinished requests wait for, in the connector's terms (the first three)."""
        waits = {Phase.TRANSMISSION: "its asynchronous load, which get_finished never reported",
                 Phase.SAVING: "its asynchronous save, which get_finished never reported",
                 Phase.WAITING: "pages (deferred)", Phase.CONTEXT: "prefill", Phase.GENERATION: "generation"}
        parts = [f"request {s.request_id} waits for {waits.get(s.phase, s.phase.value)}" for s in self.live_states[:3]]
        return "; ".join(parts)

    def step(self) -> Batch:
        # Subscribers come and go: the page table reports evictions only while one reads them
        # (a block-fidelity replay evicts millions of pages).
        self.manager.page_table.on_evict = self._on_evict if self.events.wants(Evicted) else None
        self.iteration += 1
        self.stats.iterations = self.iteration
        self._skip_idle_time()
        progress_before = self._progress_mark()
        running = [s for s in self._started if s.phase in (Phase.CONTEXT, Phase.GENERATION)]
        loading = [s for s in self._started if s.phase is Phase.TRANSMISSION]
        visited: list[tuple[RequestState, int]] = []
        batch = self.scheduler.schedule(running, self._arrived_waiting(visited), self.iteration, loading)
        self.stats.num_deferrals += sum(s.num_deferrals - before for s, before in visited)
        self._move_started(visited)
        for state in batch.received:
            item = PassItem(state.request_id, state.request.get_tokens(), state.kv.page_indices_by_group(), 0,
                            state.position, False)
            self.fake.write_context(item)
            self._received.append(item)
            state.kv.commit(state.request.prompt_token_ids[:state.position])
        dummies = self._dummies(batch)
        items = self._pass_items(batch) + [item for _, item in dummies]
        self._run_pass(batch, items)
        for dummy, item in dummies:
            dummy.close()
            self._forget(item.request_id)
        self._finish_pass(batch, items)
        self._end_iteration(batch)
        self._check_progress(batch, progress_before)
        seconds = self.config.iteration_seconds if self.config.iteration_time is None else \
            self.config.iteration_time(batch, items)
        if self.events.wants(PassDone):
            started = {s.request_id: s for s in batch.first_chunks}
            started.update((s.request_id, s) for s in self._started if s.delivered_at == self.iteration)
            self.emit(PassDone, items=tuple((i.request_id, i.start, i.end) for i in items if i.request_id >= 0),
                      seconds=seconds, pages_in_use=self._pages_in_use(),
                      hit_tokens=sum(s.num_local_hit + s.num_external for s in started.values()))
        self.clock = round(self.clock + seconds, 9)
        return batch

    def _pages_in_use(self) -> int:
        """Slots not free, over every pool group (cached pages included)."""
        return sum(n - self.manager.num_free_slots(i) for i, n in enumerate(self.manager.num_slots))

    def _skip_idle_time(self) -> None:
        if self._started:
            return
        pending = [s.request.arrival for s in self._waiting.values() if s.request.arrival > self.clock]
        if pending and len(pending) == len(self._waiting):
            self.clock = min(pending)

    def _arrived_waiting(self, visited: list[tuple[RequestState, int]]):
        """The waiting requests that have arrived, in order, lazily: the scheduler stops at the
        first it cannot take. Each one it is handed goes into `visited` with its deferral count."""
        for state in list(self._waiting.values()):
            if state.phase is Phase.WAITING and state.request.arrival <= self.clock and state.paused_at != self.iteration:
                visited.append((state, state.num_deferrals))
                yield state

    def _move_started(self, visited: list[tuple[RequestState, int]]) -> None:
        """Requests the scheduler admitted leave the queue for the started list (arrival order)."""
        for state, _ in visited:
            if state.phase is not Phase.WAITING and self._waiting.pop(state.request_id, None) is not None:
                insort(self._started, state, key=_arrival_order)

    def _progress_mark(self) -> tuple:
        """What changes when an iteration makes progress: a started request's phase, or the queue."""
        return [(s.request_id, s.phase) for s in self._started], len(self._waiting)

    def _pass_items(self, batch: Batch) -> list[PassItem]:
        items = []
        for state, n in batch.context:
            samples = state.position + n == state.prompt_len and state.request.max_new_tokens > 0
            items.append(PassItem(state.request_id, state.request._token_view(), state.kv.page_indices_by_group(),
                                  state.position, state.position + n, samples))
        for state in batch.generation:
            items.append(self._generation_item(state))
        return items

    def _generation_item(self, state: RequestState) -> PassItem:
        """A decode step: the last token, and with drafts the K drafts after it (the verify pass
        writes KV for all of them; it samples after the last accepted one)."""
        request, length = state.request, state.request.get_num_tokens()
        pages = state.kv.page_indices_by_group()
        if not state.num_drafts:
            request.py_draft_tokens = []
            return PassItem(state.request_id, request._token_view(), pages, length - 1, length, True)
        drafts = self.drafts.propose(state.request_id, length, state.num_drafts)
        request.py_draft_tokens = drafts
        state.accepted_drafts = drafts[:self.drafts.accepted(state.request_id, length, state.num_drafts)]
        return PassItem(state.request_id, request._token_view() + drafts, pages, length - 1, length + len(drafts),
                        True, sample_end=length + len(state.accepted_drafts))

    def _dummies(self, batch: Batch) -> list[tuple]:
        wanted = self.config.pad_generation_batch_to - len(batch.generation)
        if not batch.generation or wanted <= 0:
            return []
        dummies = []
        for i in range(wanted):
            request_id = -(self.iteration * 1000 + i + 1)
            kv = self.manager.create_kv_cache(request_id, [])
            kv.resume()
            if not kv.resize(1):
                kv.close()
                break
            dummies.append((kv, PassItem(request_id, [0], kv.page_indices_by_group(), 0, 1, False)))
        return dummies

    # ---- the pass (kvtool.engine.pass_driver) ------------------------------------------------
    def _guarded(self, hook: str, fn, *args):
        """Rank 0's hook guard: the runtime's (failures recorded), or a plain call without a connector."""
        return self.connector.call(hook, fn, *args) if self.connector is not None else (True, fn(*args))

    def _run_pass(self, batch: Batch, items: list[PassItem]) -> None:
        """Steps 1-2 of `pass_driver` on every rank: metadata and `start_load_kv` when requests
        were scheduled, the forward pass when the batch holds any."""
        plan = PassPlan(starts=self.connector is not None and bool(batch.num_requests or batch.loading_started),
                        forwards=bool(items))
        if not plan.starts and not plan.forwards:
            return
        ok, metadata = True, None
        if plan.starts:
            ok, metadata = self.connector.build_meta(build_scheduler_output(batch, self.iteration))
            plan = plan if ok else PassPlan(starts=False, forwards=False)
        self._send(PassOrder(self.iteration, metadata, items, self._received, self._take_page_log(), plan,
                             self._pages_to_verify(items)))
        self._received = []
        ok = self.driver.run_pass(plan, metadata, items) and ok
        if self.gate is not None:
            self.gate.close()    # until this iteration's get_finished reports are acted on
        ok = self._merge(self._gather(), items) and ok
        if not ok:
            self._fail_pass(batch, self.connector.failures[-1].describe())
            return
        for state in batch.first_chunks:
            if state.delivered_at == self.iteration and state.num_external and state.phase is Phase.CONTEXT:
                self.emit(LoadFinished, request_id=state.request_id)

    def _collect_finished(self, batch: Batch) -> None:
        """Step 4 of `pass_driver`: `get_finished` on every rank, after this iteration's
        `request_finished` calls; the ids every rank reported are acted on."""
        runtime = self.connector
        saving, loading = runtime.ids_to_report() if runtime is not None else ([], [])
        self._send(FinishedOrder(self._take_page_log(), saving, loading, self._forgotten, self._rewinds))
        self._forgotten, self._rewinds = [], {}
        answers = self.driver.get_finished(saving, loading)
        answers.update((r.rank, (r.finished is not None, r.finished)) for r in self._gather())
        if runtime is None:
            return
        saved, loaded, ok = runtime.collect_finished(answers)
        if not ok:
            self._fail_pass(batch, runtime.failures[-1].describe())
        for request_id in loaded:
            self._loaded(self.states.get(request_id))
        for request_id in saved:
            self._saved(self.states.get(request_id))
            hold = self._failed_saves.pop(request_id, None)
            if hold is not None:
                hold.release()

    # ---- the follower ranks --------------------------------------------------------------------
    def _send(self, order) -> None:
        if self.followers is not None:
            self.followers.broadcast(order)

    def _take_page_log(self) -> list[tuple]:
        """The byte operations rank 0's manager did on pages since the last order (poison,
        copy-on-write), for the followers to replay on their shards."""
        if self.followers is None:
            return []
        log, self.manager.page_log = self.manager.page_log, []
        return log

    def _forget(self, request_id: int) -> None:
        """The fake engine (on every rank) drops what it keeps for a request that is over."""
        self.fake.forget(request_id)
        if self.followers is not None:
            self._forgotten.append(request_id)

    def _pages_to_verify(self, items: list[PassItem]) -> list[PassItem]:
        """For the followers' `verify_all`: the live requests this pass does not run (their pages
        must not change; a pass's own requests are checked by its forward, and one that fails in
        the pass may hold pages its loads never filled)."""
        if not self.config.verify_all_after_iteration or self.followers is None:
            return []
        in_pass = {item.request_id for item in items}
        return [PassItem(s.request_id, s.request.get_tokens(), s.kv.page_indices_by_group(), 0, s.kv.history_length,
                         False)
                for s in self._started
                if s.kv is not None and s.phase in (Phase.CONTEXT, Phase.GENERATION) and s.kv.is_active
                and s.request_id not in in_pass]

    def _gather(self) -> list[RankReport]:
        return self.followers.gather() if self.followers is not None else []

    def _merge(self, reports: list[RankReport], items: list[PassItem]) -> bool:
        """Fold the followers' pass reports in: their hook failures, integrity issues and (tensor
        parallel) token digests. False when a follower's hook raised."""
        ok = True
        by_id = {item.request_id: item for item in items}
        for report in reports:
            for (hook, error), text in zip(report.failures, report.tracebacks):
                if self.connector is not None:
                    self.connector.failures.append(HookFailure(hook, None, error, text))
                ok = False
            self.fake.merge(report.issues, report.errors_by_request, report.rank)
            if self.config.tp_size > 1:
                for request_id, checksum in report.checksums.items():
                    by_id[request_id].checksum = (by_id[request_id].checksum + checksum) & CHECKSUM_MASK
        return ok

    def _fail_pass(self, batch: Batch, reason: str) -> None:
        """A worker hook raised: the requests of the pass fail (those already finished and
        saving keep their pages until the save is reported)."""
        for state in [s for s, _ in batch.context] + batch.generation:
            if state.is_live and state.phase is not Phase.SAVING:
                self.fail(state, FailureReason.CONNECTOR_FAILED_IN_PASS, reason)
        batch.context, batch.generation = [], []

    # ---- after the pass ----------------------------------------------------------------------
    def _finish_pass(self, batch: Batch, items: list[PassItem]) -> None:
        by_id = {item.request_id: item for item in items}
        for state, n in batch.context:
            item = by_id[state.request_id]
            state.kv.commit(state.request._prompt_view()[state.kv.num_committed_tokens:item.end])
            self.stats.recomputed_tokens += max(0, min(item.end, state.recompute_until) - state.position)
            state.position = item.end
            state.request._set_context_position(item.end)
            self.stats.computed_tokens += n
            if item.end == state.prompt_len:
                self._produce(state, item)
        for state in batch.generation:
            item = by_id[state.request_id]
            self._accept(state, item)
            self._produce(state, item)
            self._rewind_rejected(state, item)

    def _accept(self, state: RequestState, item: PassItem) -> None:
        """A decode step's tokens whose KV is now right: the last token and the accepted drafts
        (committed, so the radix tree holds only blocks of tokens that happened); the KV of
        rejected drafts stays in the pages as garbage until overwritten."""
        accepted, state.accepted_drafts = state.accepted_drafts, []
        state.kv.commit([state.request.last_token, *accepted])
        for token in accepted:
            state.request._append_token(token)
        self.stats.computed_tokens += item.end - item.start
        self.stats.generated_tokens += len(accepted)

    def _rewind_rejected(self, state: RequestState, item: PassItem) -> None:
        """The fake engine (every rank) forgets the prefix hashes of the rejected drafts (after
        the sample, which reads the pass's hashes)."""
        if item.end > item.sampled_after:
            self.fake.rewind(state.request_id, item.sampled_after)
            if self.followers is not None:
                self._rewinds[state.request_id] = item.sampled_after

    def _end_iteration(self, batch: Batch) -> None:
        """`get_finished` (with a connector or followers), then the checks of the iteration."""
        if self.connector is not None or self.followers is not None:
            self._collect_finished(batch)
        if self.gate is not None:
            self.gate.open()
        self._fail_stuck_transmissions()
        if self.config.verify_all_after_iteration:
            self.verify_all()
        if self.config.check_integrity_every_iteration:
            check_manager(self.manager)

    def _produce(self, state: RequestState, item: PassItem) -> None:
        if state.request.max_new_tokens > 0:
            state.request._append_token(self.fake.sample(item))
            self.stats.generated_tokens += 1
        if state.request.is_finished:
            self._finish(state)
        else:
            state.start_generation()

    def _finish(self, state: RequestState) -> None:
        pages = state.kv.page_indices_by_group()
        is_async = False
        if self.connector is not None and state.seen_by_connector:
            ok, is_async = self.connector.finish(state.request, pages)
            if not ok:
                self._close(state, Phase.FAILED, FailureReason.FINISHED_HOOK_RAISED)
                return
        self._emit_finished(state, None)
        if is_async:
            state.start_saving(self.manager.hold_pages(state.kv))
            state.kv.close()
            self.emit(SaveStarted, request_id=state.request_id)
        else:
            self._close(state, Phase.DONE)

    def _emit_finished(self, state: RequestState, failure: FailureReason | None) -> None:
        self.emit(Finished, request_id=state.request_id, failure=failure,
                  num_generated_tokens=state.request.num_generated_tokens, prompt_len=state.request.original_prompt_len,
                  num_local_hit=state.num_local_hit, num_external=state.num_external, arrival=state.request.arrival)

    def _loaded(self, state: RequestState | None) -> None:
        if state is not None and state.phase is Phase.TRANSMISSION:
            state.load_landed()
            self.emit(LoadFinished, request_id=state.request_id)

    def _saved(self, state: RequestState | None) -> None:
        if state is not None and state.phase is Phase.SAVING:
            state.end(Phase.DONE)
            self.emit(SaveFinished, request_id=state.request_id)
            self._drop_if_forgetting(state)

    def _fail_stuck_transmissions(self) -> None:
        seconds, limit = self.config.max_transmission_seconds, self.config.max_transmission_iterations
        now = time.monotonic()
        for state in [s for s in self._started if s.phase is Phase.TRANSMISSION]:
            if seconds is not None and now - state.transmission_started_at > seconds:
                self.fail(state, FailureReason.STUCK_IN_TRANSMISSION, f"for more than {seconds:g} s")
            elif seconds is None and self.iteration - state.transmission_since > limit:
                self.fail(state, FailureReason.STUCK_IN_TRANSMISSION, f"for more than {limit} iterations")
        self._fail_stuck_saves(now)

    def _fail_stuck_saves(self, now: float) -> None:
        """`max_saving_seconds`: fail a request whose asynchronous save is unreported that long after
        the end of the iteration that finished it (when this check first saw it saving)."""
        seconds = self.config.max_saving_seconds
        if seconds is None:
            return
        since = self.__dict__.setdefault("_saving_since", {})   # request id -> when first seen saving
        saving = [s for s in self._started if s.phase is Phase.SAVING]
        for request_id in set(since) - {s.request_id for s in saving}:
            del since[request_id]
        for state in saving:
            if now - since.setdefault(state.request_id, now) > seconds:
                self.fail(state, FailureReason.STUCK_IN_TRANSMISSION, f"request {state.request_id} waits for its "
                          f"asynchronous save, which get_finished never reported within {seconds:g} s")

    def idle_for_connector(self) -> None:
        """Nothing can run until the connector's background copies land: let them run a moment
        (`idle_wait_seconds`; the store bench books this time to the connector)."""
        time.sleep(self.config.idle_wait_seconds)

    def _check_progress(self, batch: Batch, progress_before: tuple) -> None:
        """Raise when nothing ran, nothing changed and nothing is in flight: the cache is too small."""
        if batch.num_requests or batch.received or progress_before != self._progress_mark():
            return
        if any(s.phase in (Phase.TRANSMISSION, Phase.SAVING) for s in self._started):
            self.idle_for_connector()
            return
        arrived = [s for s in self.live_states if s.request.arrival <= self.clock]
        if arrived and not any(s.request.arrival > self.clock for s in self.live_states):
            stuck = arrived[0]
            raise OutOfPagesError(f"the KV cache is too small: request {stuck.request_id} "
                                  f"({stuck.prompt_len} prompt tokens) cannot get pages and nothing else can run"
                                  + ("" if self.scheduler.config.reserve_outputs or self.scheduler.config.pause_to_grow
                                     else " (running requests filled the pool as they grew; admission that "
                                     "reserves their outputs avoids this: --admission reserve, and so does "
                                     "pausing the request started last: --admission max-utilization)"))

    # ---- failure -----------------------------------------------------------------------------
    def fail(self, state: RequestState, reason: FailureReason, detail: str = "") -> None:
        """Fail one request cleanly: hand back an undelivered offer, let the connector forget it,
        release its pages. Other requests are untouched. `state.error` reads "<reason>: <detail>"."""
        if not state.is_live:
            return
        if self.connector is not None:
            offer = state.offer
            if offer is not None and not offer.closed:
                offer.closed = True
                self.scheduler.cancel(state, offer.start, offer.end)
            if (state.seen_by_connector or state.asked) and state.phase is not Phase.SAVING:
                is_open = state.kv is not None and state.kv.status is not KvCacheStatus.CLOSED
                pages = state.kv.page_indices_by_group() if is_open else \
                    GroupPages([] for _ in self.manager.layer_groups)
                ok, is_async = self.connector.finish(state.request, pages)
                if ok and is_async and is_open:   # its save reads these pages: keep them until it lands
                    self._failed_saves[state.request_id] = self.manager.hold_pages(state.kv)
        self._close(state, Phase.FAILED, reason, detail)

    def _close(self, state: RequestState, phase: Phase, failure: FailureReason | None = None,
               detail: str = "") -> None:
        """End a request in `phase`; a FAILED one records `failure` and "<reason>: <detail>" as its error."""
        if failure is not None and state.phase is not Phase.SAVING:
            self._emit_finished(state, failure)
        reason = None if failure is None else f"{failure.value}: {detail}" if detail else failure.value
        if state.kv is not None:
            state.kv.close()
        state.end(phase, failure, reason)
        self._forget(state.request_id)
        if phase is Phase.FAILED:
            self.stats.num_failed += 1
            self.stats.failures.append(f"request {state.request_id}: {reason}")
        self._drop_if_forgetting(state)

    def _drop_if_forgetting(self, state: RequestState) -> None:
        if state.is_live:
            return
        self.stats.num_finished += 1
        if self._waiting.pop(state.request_id, None) is None:
            at = next((i for i, s in enumerate(self._started) if s is state), None)
            if at is not None:
                del self._started[at]
        if self.config.forget_finished:
            self.states.pop(state.request_id, None)

    def verify_all(self) -> None:
        """Check the fingerprints of every live page of every request whose KV is complete."""
        for state in list(self._started):
            if state.kv is not None and state.phase in (Phase.CONTEXT, Phase.GENERATION) and state.kv.is_active:
                self.fake.verify_cache(state.request_id, state.request.get_tokens(),
                                       state.kv.page_indices_by_group(), state.kv.history_length)

    @property
    def integrity_errors(self) -> int:
        return self.fake.num_integrity_errors


def _bytes_model(fidelity: str, manager: KvCacheManager, seed: int, model_heads: int):
    """What writes and checks the pages' bytes at `fidelity` (`_require_fidelity` has passed)."""
    if fidelity == "blocks":
        return NoBytesModel(manager.layer_groups)
    model = ReferenceTokens if fidelity == "tokens" else FakeEngine
    return model(manager.layout, manager.layer_groups, seed, model_heads=model_heads)


def _require_fidelity(config: EngineConfig, connector: ConnectorSpec | None) -> None:
    """InputError for a fidelity this engine cannot run, or one the connector does not fit."""
    if config.fidelity not in ("bytes", "blocks", "tokens"):
        raise InputError(f"unknown fidelity {config.fidelity!r}: bytes or blocks (tokens: reference runs only)")
    if config.fidelity == "tokens" and (connector is not None or config.num_ranks != 1):
        raise InputError("token fidelity is for a reference run: one rank and no connector")
    moves_bytes = connector is None or getattr(connector.scheduler_class, "kvtool_moves_bytes", True)
    if config.fidelity == "blocks":
        if config.num_ranks != 1 or config.process_group_of_one:
            raise InputError("block fidelity runs one rank: drop --num-ranks (or use --fidelity bytes)")
        if connector is not None and moves_bytes:
            raise InputError(f"connector {connector.name!r} moves KV bytes, and block fidelity has none: "
                             "use --connector index, redis-index or mooncake-index (tiers that only index) "
                             "or --fidelity bytes")
    elif not moves_bytes:
        raise InputError(f"connector {connector.name!r} moves no bytes (it stands in for a tier in block "
                         "fidelity): use it with --fidelity blocks")


def _arrival_order(state: RequestState) -> int:
    return state.arrival_order


class _Lookahead:
    """An iterator whose next item can be looked at before it is taken."""

    def __init__(self, items: Iterator[Request]) -> None:
        self._items = items
        self._next: Request | None = next(items, None)

    def peek(self) -> Request | None:
        return self._next

    def take(self) -> Request:
        item, self._next = self._next, next(self._items, None)
        return item
