"""The engine loop (rank 0). An iteration schedules a batch (`scheduler`), runs its pass on every
rank (`rank_group`: build_connector_meta -> start_load_kv -> per layer wait_for_layer_load, fake
forward, save_kv_layer -> the workers' forward-pass callables -> wait_for_save), applies its tokens
(`pass_results`: commit, sample, request_finished at max_new_tokens through `lifecycle`), then
runs get_finished on every rank and acts on the reports (`lifecycle`), then its checks.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from kvtool.connector.llm_args import LlmArgs
from kvtool.connector.loader import ConnectorSpec
from kvtool.connector.rank_context import set_process_rank
from kvtool.connector.request import Request, max_kv_tokens
from kvtool.connector.runtime import HookResult
from kvtool.engine.connector_attach import attach_connector
from kvtool.engine.connector_work import connector_work_for
from kvtool.engine.drafts import DraftModel
from kvtool.engine.engine_config import EngineConfig, EngineStats
from kvtool.engine.events import Arrived, EngineEvent, EventStream, Evicted, LoadFinished, PassDone
from kvtool.engine.fidelity import bytes_model, pools_for, require_fidelity
from kvtool.engine.lifecycle import Lifecycle
from kvtool.engine.pass_driver import PassDriver, PassPlan
from kvtool.engine.pass_items import batch_items, idle_pages, padding, received_item
from kvtool.engine.pass_results import PassResults
from kvtool.engine.pass_types import PassItem
from kvtool.engine.rank_group import rank_group, start_followers
from kvtool.engine.rank_orders import FinishedOrder, PassOrder, rank_manager_config
from kvtool.engine.rank_pass import RankPass
from kvtool.engine.request_queues import Lookahead, RequestQueues
from kvtool.engine.request_state import FailureReason, Phase, RequestState
from kvtool.engine.runtimes import BringUp, profile_of
from kvtool.engine.runtimes.admission import AdmissionHost
from kvtool.engine.scheduler import Batch, Scheduler
from kvtool.engine.scheduler_output import build_scheduler_output
from kvtool.engine.watchdogs import Watchdogs, stuck_description
from kvtool.engine.worker_setup import forward_stream, rank_llm_args
from kvtool.errors import InputError, IterationLimitError, OutOfPagesError
from kvtool.manager.integrity import check_manager
from kvtool.manager.manager import KvCacheManager
from kvtool.manager.pool_groups import pages_per_pool_group
from kvtool.models import heads_across_ranks

__all__ = ["Engine", "EngineConfig", "EngineStats"]


class Engine:
    """Rank 0: the scheduler, the manager (every page index), the connector's scheduler side and
    the group of ranks. `states` holds every request added (the live ones only, with
    `forget_finished`); `events` streams what happens to them."""

    def __init__(self, config: EngineConfig, connector: ConnectorSpec | None = None,
                 connector_options: dict[str, str] | None = None) -> None:
        self.profile = profile_of(config.runtime)
        if connector is not None:
            self.profile.check(BringUp.of(config, connector))
        self.config = config
        if config.tp_size != 1 and (not config.ranks_as_processes or config.tp_size != config.num_ranks):
            raise InputError(f"--tp {config.tp_size} needs --num-ranks {config.tp_size} (one process per shard)")
        require_fidelity(config, connector)
        manager_config = pools_for(config.fidelity, rank_manager_config(config.manager, config.tp_size, 0))
        self.manager = KvCacheManager(manager_config)
        self.fake = bytes_model(config.fidelity, self.manager, config.seed, heads_across_ranks(manager_config.model))
        self.stats = EngineStats()
        self.queues = RequestQueues(config.forget_finished)
        self.states = self.queues.states
        self.clock = 0.0
        self.iteration = 0
        self.events = EventStream()
        self.manager.page_table.on_evict = self._on_evict
        self._received: list[PassItem] = []
        options = connector_options or {}
        followers = start_followers(config, self.manager, connector, options)
        self.stream = forward_stream(self.manager.device)
        set_process_rank(0, config.num_ranks)
        self.work = connector_work_for(config, connector is not None, self.emit, lambda: self.iteration,
                                       self.manager.device, self.fake)
        self.driver = PassDriver([], self.fake.layer_ids, self.fake.forward_layer, self.stream, self._guarded,
                                 on_hook=self.work.before_hook if self.work is not None else lambda hook: None)
        rank0 = RankPass(0, self.fake, self.driver, self.work.after_forward if self.work is not None else lambda: None)
        self.group = rank_group(rank0, followers, config, self.manager)
        if self.work is not None:
            self.work.install()
        try:
            self.connector = attach_connector(connector, options, self.manager, config, self.driver,
                                              self.group.num_local_ranks, self.profile) if connector else None
        except Exception:
            self.close()
            raise
        if self.work is not None and self.connector is not None:   # (work is watched only beside a connector)
            self.connector.around_hook = self.work.hook
        self.drafts = DraftModel(config.draft_tokens, config.acceptance, config.seed) if config.draft_tokens else None
        self.admission = self.profile.admission(AdmissionHost.of(
            self.manager, self.connector, connector, config.scheduler.local_reuse, config.scheduler.chunk_size,
            self.emit, self.fail))
        self.lifecycle = Lifecycle(self.connector, self.manager, self.queues, self.stats, self.emit, self.admission)
        self.scheduler = Scheduler(self.manager, config.scheduler, self.admission, self.pause, self.drafts)
        self.results = PassResults(self.fake, self.stats, self.lifecycle)
        self.watchdogs = Watchdogs(config, self.fail, self.work.clock.now if self.work is not None else time.monotonic)

    def llm_args(self, spec: ConnectorSpec, options: dict[str, str], rank: int) -> LlmArgs:
        return rank_llm_args(self.manager, spec, options, rank, self.config.num_ranks, self.config.tp_size)

    def close(self) -> None:
        """Stop the follower ranks, if any, and the hold on the connector's work (idempotent)."""
        if self.work is not None:
            self.work.uninstall()
        self.group.close()

    # ---- events ------------------------------------------------------------------------------
    def emit(self, kind: type[EngineEvent], **fields) -> None:
        """Send one event, stamped with this iteration and clock, to every subscriber of `events`."""
        if self.events.wants(kind):
            self.events.emit(kind(iteration=self.iteration, clock=self.clock, **fields))

    def _on_evict(self, page, block_ordinal: int) -> None:
        self.emit(Evicted, layer_group_id=int(page.layer_group_id), block_ordinal=block_ordinal)

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, request: Request) -> RequestState:
        self.queues.require_new_id(request)
        self._require_room_for(request)
        state = self.queues.add(request)
        self.emit(Arrived, request_id=request.request_id, prompt_len=request.prompt_len, arrival=request.arrival)
        return state

    def _require_room_for(self, request: Request) -> None:
        """InputError now for a request that could not fit even in an empty cache (it would wait forever)."""
        tokens = max_kv_tokens(request.prompt_len, request.max_new_tokens)
        manager = self.manager
        needs = pages_per_pool_group(manager.layer_groups, manager.pool_groups, tokens, manager.tokens_per_block)
        for pg, need in zip(manager.pool_groups, needs, strict=True):
            have = manager.num_slots[pg.pool_group_index]
            if need > have:
                raise InputError(f"the KV cache is too small: request {request.request_id} "
                                 f"({request.prompt_len} prompt + {request.max_new_tokens} new tokens) needs {need} "
                                 f"pages in pool group {pg.pool_group_index}, which has {have}")

    def abort(self, request_id: int) -> None:
        """Free a request wherever it is (before delivery, its whole offer is cancelled)."""
        state = self.states[request_id]
        if state.is_live:
            self.fail(state, FailureReason.ABORTED)

    def fail(self, state: RequestState, reason: FailureReason, detail: str = "") -> None:
        """`Lifecycle.fail`: one request fails cleanly, the others are untouched."""
        self.lifecycle.fail(state, reason, detail)

    def pause(self, state: RequestState) -> None:
        """TensorRT-LLM's destructive pause (MAX_UTILIZATION): the connector hears
        `request_finished` (a pause by preemption calls it, not `request_reset`; an asynchronous
        save keeps the pages until reported), the allocation is released (its committed blocks
        stay in the radix tree, so the replay may hit them locally), and the request waits to run
        again from the start, asked anew and reported as new."""
        self.lifecycle.pause(state, self.iteration)

    @property
    def live_states(self) -> list[RequestState]:
        """Every request not over yet, in arrival order."""
        return self.queues.live

    def is_done(self) -> bool:   # every request over, and no prefix load still within its bound to retire
        return self.queues.is_done() and not self.watchdogs.waits_for(self.admission.unretired_since(), self.iteration)

    # ---- the loop ----------------------------------------------------------------------------
    def run(self, max_iterations: int = 100_000, on_iteration=None) -> EngineStats:
        """Run the requests added so far until every one has finished."""
        return self.run_stream((), max_iterations, on_iteration)

    def run_stream(self, requests: Iterable[Request], max_iterations: int = 10_000_000,
                   on_iteration=None) -> EngineStats:
        """Run requests read one at a time: each is added when the clock reaches its arrival
        (arrivals must not decrease), so only the requests in flight are in memory."""
        upcoming = Lookahead(iter(requests))
        while (next_request := upcoming.peek()) is not None or not self.is_done():
            if self.is_done() and next_request is not None and next_request.arrival > self.clock:
                self.clock = next_request.arrival
            while (next_request := upcoming.peek()) is not None and next_request.arrival <= self.clock:
                self.add_request(upcoming.take())
            if self.iteration >= max_iterations:
                raise IterationLimitError(f"{len(self.live_states)} requests still unfinished after "
                                          f"{max_iterations} iterations: {stuck_description(self.live_states)}")
            self.step()
            if on_iteration is not None:
                on_iteration(self)
        return self.stats

    def step(self) -> Batch:
        """One iteration: schedule -> the pass on every rank -> its tokens -> get_finished and checks."""
        self._start_iteration()
        progress_before = (self.queues.progress_mark(), len(self.lifecycle.holds))   # a hold released: progress
        batch = self._schedule()
        dummies = padding(self.manager, batch, self.iteration, self.config.pad_generation_batch_to)
        items = batch_items(batch, self.drafts) + [item for _, item in dummies]
        self._run_pass(batch, items)
        for kv, item in dummies:
            kv.close()
            self.lifecycle.forget(item.request_id)
        self.results.apply(batch, items)
        self._end_iteration(batch)
        self._check_progress(batch, progress_before)
        self._advance_clock(batch, items)
        return batch

    def _start_iteration(self) -> None:
        # Subscribers come and go: the page table reports evictions only while one reads them
        # (a block-fidelity replay evicts millions of pages).
        self.manager.page_table.on_evict = self._on_evict if self.events.wants(Evicted) else None
        self.iteration += 1
        self.stats.iterations = self.iteration
        self.clock = self.queues.next_arrival_when_idle(self.clock)

    def _schedule(self) -> Batch:
        """The scheduler's batch; the requests it admitted move to the started list, and a
        received context is committed (every rank writes its bytes with the pass)."""
        running = self.queues.started_in(Phase.CONTEXT, Phase.GENERATION)
        loading = self.queues.started_in(Phase.TRANSMISSION)
        visited: list[tuple[RequestState, int]] = []
        waiting = self.queues.arrived_waiting(self.clock, self.iteration, visited)
        batch = self.scheduler.schedule(running, waiting, self.iteration, loading)
        self.stats.num_deferrals += sum(s.num_deferrals - before for s, before in visited)
        self.queues.move_started(visited)
        for state in batch.received:
            self._received.append(received_item(state))
            state.held_kv.commit(state.request.prompt_token_ids[:state.position])
        return batch

    def _guarded(self, hook: str, fn, *args):
        """Rank 0's hook guard: the runtime's (failures recorded), or a plain call without a connector."""
        return self.connector.call(hook, fn, *args) if self.connector is not None else HookResult(True, fn(*args))

    def _run_pass(self, batch: Batch, items: list[PassItem]) -> None:
        """Steps 1-2 of `pass_driver` on every rank: metadata and `start_load_kv` when requests
        were scheduled, the forward pass when the batch holds any."""
        plan = PassPlan(starts=self.connector is not None and bool(batch.num_requests or batch.loading_started),
                        forwards=bool(items))
        if not plan.starts and not plan.forwards:
            return
        ok, metadata = True, None
        if plan.starts and self.connector is not None:   # (it starts only with a connector)
            ok, metadata = self.connector.build_meta(build_scheduler_output(
                batch, self.iteration, self.profile, self.admission.take_prefix_loads()))
            plan = plan if ok else PassPlan(starts=False, forwards=False)
        verify = idle_pages(self.queues.started, items) if self.group.needs_idle_pages else []
        order, self._received = PassOrder(self.iteration, metadata, items, self._received, [], plan, verify), []
        outcome = self.group.run_pass(order)
        if self.connector is not None:
            self.connector.failures.extend(outcome.failures)
        if not (outcome.ok and ok):
            assert self.connector is not None   # only a connector's hooks fail a pass
            self._fail_pass(batch, self.connector.failures[-1].describe())
            return
        for state in batch.first_chunks:
            if state.delivered_at == self.iteration and state.num_external and state.phase is Phase.CONTEXT:
                self.emit(LoadFinished, request_id=state.request_id)

    def _fail_pass(self, batch: Batch, reason: str) -> None:
        self.lifecycle.fail_pass([s for s, _ in batch.context] + batch.generation + batch.loading_started, reason)
        batch.context, batch.generation = [], []

    def _end_iteration(self, batch: Batch) -> None:
        """`get_finished` on every rank and its reports acted on, then the iteration's checks."""
        self._collect_finished(batch)
        if self.work is not None:
            self.work.at_gate()
        self.watchdogs.check(self.queues, self.iteration)
        if self.config.verify_all_after_iteration:
            self.verify_all()
        if self.config.check_integrity_every_iteration:
            check_manager(self.manager)

    def _collect_finished(self, batch: Batch) -> None:
        """Step 4 of `pass_driver`: `get_finished` on every rank, after this iteration's
        `request_finished` calls; the ids every rank reported are acted on."""
        runtime = self.connector
        saving, loading = runtime.ids_to_report() if runtime is not None else ([], [])
        order = FinishedOrder([], saving, loading, self.lifecycle.take_forgotten(), self.results.take_rewinds(),
                              prefix_loads=runtime is not None and self.admission.uses_prefix_loads)
        outcome = self.group.finish(order)
        if runtime is None:
            return
        runtime.failures.extend(outcome.failures)
        saved, loaded, ok = runtime.collect_finished(outcome.answers)
        retired, prefix_ok = self.admission.retire_reported(outcome.prefix_loads)
        if not (ok and prefix_ok):
            self._fail_pass(batch, runtime.failures[-1].describe())
        for request_id in loaded:
            self.lifecycle.loaded(request_id)
        for request_id in retired:
            self.lifecycle.prefix_load_done(request_id)
        for request_id in saved:
            self.lifecycle.saved(request_id)

    def idle_for_connector(self) -> None:
        """Nothing can run until the connector's background copies land: let them run a moment
        (`idle_wait_seconds`; the store bench books this time to the connector); held work runs instead."""
        if self.work is not None:
            return self.work.idle(self.config.idle_wait_seconds)
        time.sleep(self.config.idle_wait_seconds)

    def _check_progress(self, batch: Batch, progress_before: tuple) -> None:
        """Raise when nothing ran, nothing changed and nothing is in flight: the cache is too small."""
        mark = (self.queues.progress_mark(), len(self.lifecycle.holds))
        if batch.num_requests or batch.received or progress_before != mark:
            return
        if self.queues.started_in(Phase.TRANSMISSION, Phase.SAVING) or self.admission.unretired_since() \
                or self.lifecycle.holds:
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

    def _advance_clock(self, batch: Batch, items: list[PassItem]) -> None:
        """The iteration's simulated seconds (`PassDone` says them), added to the clock."""
        seconds = self.config.iteration_seconds if self.config.iteration_time is None else \
            self.config.iteration_time(batch, items)
        if self.events.wants(PassDone):
            started = {s.request_id: s for s in batch.first_chunks}
            started.update((s.request_id, s) for s in self.queues.started if s.delivered_at == self.iteration)
            self.emit(PassDone, items=tuple((i.request_id, i.start, i.end) for i in items if i.request_id >= 0),
                      seconds=seconds, pages_in_use=self._pages_in_use(),
                      hit_tokens=sum(s.num_local_hit + s.num_external for s in started.values()))
        self.clock = round(self.clock + seconds, 9)

    def _pages_in_use(self) -> int:
        """Slots not free, over every pool group (cached pages included)."""
        return sum(n - self.manager.num_free_slots(i) for i, n in enumerate(self.manager.num_slots))

    # ---- checks ------------------------------------------------------------------------------
    def verify_all(self) -> None:
        """Check the fingerprints of every live page of every request whose KV is complete."""
        for state in list(self.queues.started):
            if state.kv is not None and state.phase in (Phase.CONTEXT, Phase.GENERATION) and state.kv.is_active:
                self.fake.verify_cache(state.request_id, state.request.get_tokens(),
                                       state.kv.page_indices_by_group(), state.kv.history_length)

    @property
    def integrity_errors(self) -> int:
        return self.fake.num_integrity_errors

