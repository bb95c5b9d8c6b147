"""Prefix reservations (`main`'s V2, prefix-aware scheduling) through the engine, with the built-in
`host-reserve` and with scripted reserving connectors written here.

Sources (/work/notes/trtllm-main-v2.md sections 2-4): the reservation manager of
brb-nv/TensorRT-LLM@64ecf956 (`reserve_prefix` with a fresh id per attempt, the clamp and block
floor with the rest released, `accept_prefix_load`, `finish_prefix_loads`,
`configure_prefix_reservations`' ValueError "KV connector prefix reservations require ..."), the
unit tests read by id 68375241723 and 68652947412 (test_rejected_connector_candidate_releases_and_rewinds,
test_reserved_prefix_tracks_range_and_allocation, test_confirmed_async_load_survives_a_second_output_build,
test_cancelled_load_waits_for_every_rank, test_stale_completion_cannot_finish_a_replayed_allocation,
test_partial_reservation_capability_is_rejected, test_legacy_connectors_do_not_enable_reservations),
NVIDIA/TensorRT-LLM@785b0128 connectors/prefix_load_completion.py (a load retires once every rank
reported it) and the connector docs' lifecycle table "Reserving a prefix during admission"
(candidate queried / rejected / accepted / cancelled during transmission / every worker completes).

The invariant every test checks (`released_once`): each promise's tokens [start, start + count)
are released exactly once, in parts that tile it, each `release_prefix_reservation` call matching
one ReservationReleased event and one entry of `ConnectorRuntime.releases`.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvtool.connector.api import KvCacheConnectorScheduler, PrefixLoad
from kvtool.connector.loader import ConnectorSpec
from kvtool.connector.request import Request
from kvtool.connectors.host import ReservingHostScheduler
from kvtool.connectors.registry import load_connector
from kvtool.engine.engine import Engine, EngineConfig
from kvtool.engine.events import (
    EventLog,
    Finished,
    LoadFinished,
    PassDone,
    PrefixLoadRetired,
    ReservationReleased,
    Reserved,
)
from kvtool.engine.pass_types import PassItem
from kvtool.engine.request_state import FailureReason, Phase
from kvtool.engine.runtimes import RuntimeName
from kvtool.engine.runtimes.trtllm_v2 import FinalBatchAdmission, ReservingAdmission
from kvtool.engine.scheduler import SchedulerConfig
from kvtool.errors import OutOfPagesError, RefusedSetupError
from kvtool.group_pages import GroupPages
from kvtool.manager import KvCacheManagerConfig
from kvtool.manager.integrity import check_manager
from kvtool.models import load_model
from kvtool.types import KvCacheStatus
from tests.helpers.connectors import NoOpWorker
from tests.helpers.engines import make_engine
from tests.helpers.mock_connector import mock_connector

V1, V2, RELEASE = RuntimeName.TRTLLM_V1, RuntimeName.TRTLLM_V2, RuntimeName.TRTLLM_V2_RELEASE


# ---- a scripted reserving connector ------------------------------------------------------------

class ReservingScheduler(KvCacheConnectorScheduler):
    """Promises `answer(request, num_computed_tokens)` and records every call; its metadata is the
    iteration's `prefix_loads`."""

    answer = staticmethod(lambda request, num_computed: (0, False))

    def __init__(self, llm_args) -> None:
        super().__init__(llm_args)
        self.calls: list[tuple] = []
        self.outputs: list = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.calls.append(("ask", request.request_id, num_computed_tokens))
        return 0, False

    def reserve_prefix(self, request, num_computed_tokens, reservation_id):
        self.calls.append(("reserve", request.request_id, num_computed_tokens, reservation_id))
        return type(self).answer(request, num_computed_tokens)

    def release_prefix_reservation(self, request, reservation_id, start, end):
        self.calls.append(("release", request.request_id, reservation_id, start, end))

    def update_state_after_alloc(self, request, block_ids):
        self.calls.append(("alloc", request.request_id, list(block_ids)))

    def build_connector_meta(self, scheduler_output):
        self.outputs.append(scheduler_output)
        return list(scheduler_output.prefix_loads)

    def request_finished(self, request, cache_block_ids):
        self.calls.append(("finished", request.request_id, list(cache_block_ids)))
        return False

    def of(self, kind: str, request_id: int | None = None) -> list[tuple]:
        return [c[1:] for c in self.calls if c[0] == kind and (request_id is None or c[1] == request_id)]


class ReportingWorker(NoOpWorker):
    """Writes each confirmed load's bytes at `start_load_kv` and reports it `lag(rank, reservation_id)`
    calls of `get_finished_prefix_loads` later (0: in the same iteration)."""

    lag = staticmethod(lambda rank, reservation_id: 0)
    fake = None   # the engine's FakeEngine (make_engine sets it)

    def __init__(self, llm_args) -> None:
        super().__init__(llm_args)
        self.rank = llm_args.rank
        self.pending: dict[int, int] = {}
        self.reported: list[list[int]] = []
        self.finished_calls: list[tuple] = []

    def register_kv_cache_layout(self, layout):
        self.layout = layout

    def register_kv_caches(self, kv_cache_tensor):
        self.tensor = kv_cache_tensor

    def start_load_kv(self, stream):
        for load in self._metadata or []:
            self.fake.write_context(PassItem(load.request_id, load.tokens, GroupPages(load.block_ids_by_layer_group),
                                             load.start, load.end, False))
            self.pending[load.reservation_id] = type(self).lag(self.rank, load.reservation_id)

    def get_finished(self, finished_gen_req_ids, started_loading_req_ids):
        self.finished_calls.append((list(finished_gen_req_ids), list(started_loading_req_ids)))
        return [], []

    def get_finished_prefix_loads(self):
        done = sorted(rid for rid, left in self.pending.items() if left <= 0)
        self.pending = {rid: left - 1 for rid, left in self.pending.items() if left > 0}
        self.reported.append(done)
        return done


def reserving(answer, lag=lambda rank, reservation_id: 0) -> ConnectorSpec:
    scheduler = type("Reserving", (ReservingScheduler,), {"answer": staticmethod(answer)})
    worker = type("Reporting", (ReportingWorker,), {"lag": staticmethod(lag)})
    return ConnectorSpec("reserving", scheduler, worker, __name__)


def logged(engine) -> EventLog:
    log = EventLog()
    engine.events.subscribe(log)
    return log


def released_once(engine, log: EventLog, scheduler_releases: list[tuple] | None = None) -> None:
    """Every promise's tokens released exactly once, in parts that tile it; the runtime's record,
    the events and (given) the connector's own record agree call for call."""
    released = [(e.request_id, e.reservation_id, e.start, e.end) for e in log.of(ReservationReleased)]
    assert released == engine.connector.releases
    if scheduler_releases is not None:
        assert scheduler_releases == released
    promises = {e.reservation_id: (e.request_id, e.start, e.end) for e in log.of(Reserved)}
    assert len(promises) == len(log.of(Reserved))                      # fresh ids: never one twice
    assert {rid for _, rid, _, _ in released} <= set(promises)
    for rid, (request_id, start, end) in promises.items():
        parts = sorted((s, e) for r, i, s, e in released if i == rid and r == request_id)
        assert len(parts) == len([1 for _, i, _, _ in released if i == rid])
        position = start
        for s, e in parts:
            assert (s, e > s) == (position, True), (rid, parts)
            position = e
        assert position == end, (rid, start, end, parts)


# ---- host-reserve ---------------------------------------------------------------------------------

def test_host_reserve_serves_a_stored_prompt_through_one_confirmed_prefix_load(monkeypatch):
    # Legacy asks are skipped when reservations are on (`_run_kv_connector_hooks` returns early).
    legacy_asks = []
    monkeypatch.setattr(ReservingHostScheduler, "get_num_new_matched_tokens",
                        lambda self, request, n: legacy_asks.append(request.request_id) or (0, False))
    engine = make_engine(load_connector("host-reserve"), num_slots=64, runtime=V2, local_reuse=False)
    assert isinstance(engine.admission, ReservingAdmission)
    log = logged(engine)
    prompt = list(range(100, 142))                                   # 42 tokens: 10 full blocks and 2
    engine.add_request(Request(1, prompt, 3, cache_salt="tenant"))
    engine.run()
    seen = []
    build = engine.connector.scheduler.build_connector_meta
    monkeypatch.setattr(engine.connector.scheduler, "build_connector_meta", lambda out: seen.append(out) or build(out))
    engine.add_request(Request(2, prompt, 3, cache_salt="tenant"))
    engine.run()
    (load,) = seen[0].prefix_loads                                   # id 1 was request 1's attempt (nothing stored)
    assert (load.reservation_id, load.request_id, load.start, load.end, load.is_async, load.tokens,
            load.cache_salt) == (2, 2, 0, 40, False, prompt, "tenant")
    (first,) = seen[0].new_requests                                  # its pages: the load's, from block 0
    assert (first.request_id, first.computed_position, first.num_scheduled_tokens) == (2, 0, 2)
    assert load.block_ids_by_layer_group == [first.new_block_ids] and len(first.new_block_ids) == 11
    assert [(e.reservation_id, e.start, e.end) for e in log.of(Reserved)] == [(2, 0, 40)]
    assert engine.connector.releases == [(2, 2, 0, 40)] and legacy_asks == []
    assert [(e.request_id, e.num_external) for e in log.of(Finished)] == [(1, 0), (2, 40)]
    assert engine.connector.scheduler.kvtool_introspection().pinned_entries == 0
    assert engine.integrity_errors == 0 and engine.stats.failures == []
    released_once(engine, log)
    check_manager(engine.manager)


def test_host_reserve_releases_each_rejected_candidate_whole_and_retries_under_a_new_id():
    # Request 3 fills the pool while request 2 (a stored prompt) waits: every attempt of 2 is a
    # candidate whose first chunk cannot get pages, released whole; the store unpins each.
    engine = make_engine(load_connector("host-reserve"), num_slots=16, runtime=V2, local_reuse=False)
    log = logged(engine)
    stored = list(range(100, 130))
    engine.add_request(Request(1, stored, 1))
    engine.run()
    engine.add_request(Request(3, list(range(500, 548)), 8))          # 12 of 16 pages while it runs
    engine.add_request(Request(2, stored, 1))
    engine.run()
    attempts = [(e.reservation_id, e.start, e.end) for e in log.of(Reserved) if e.request_id == 2]
    ids = [rid for rid, _, _ in attempts]
    assert len(ids) == engine.states[2].num_deferrals + 1 >= 2
    assert ids == list(range(ids[0], ids[0] + len(ids))) and {(s, e) for _, s, e in attempts} == {(0, 28)}
    assert [r for r in engine.connector.releases if r[0] == 2] == [(2, rid, 0, 28) for rid in ids]
    assert [e.reservation_id for e in log.of(PrefixLoadRetired)] == [ids[-1]]
    assert engine.connector.scheduler.kvtool_introspection().pinned_entries == 0
    assert engine.integrity_errors == 0 and engine.stats.failures == []
    released_once(engine, log)


# ---- scripted: ids, clamps, releases ------------------------------------------------------------

def test_every_attempt_gets_a_fresh_id_and_a_rejected_candidate_is_released_whole():
    # test_rejected_connector_candidate_releases_and_rewinds: request 2's promise of 20 gets pages,
    # its first chunk [20, 40) does not while request 1 holds 10 of 16; retried every iteration.
    spec = reserving(lambda request, n: (20, False) if request.request_id == 2 else (0, False))
    engine = make_engine(spec, num_slots=16, runtime=V2)
    log = logged(engine)
    engine.add_request(Request(1, list(range(100, 140)), 8))
    engine.add_request(Request(2, list(range(200, 240)), 2))
    engine.run()
    s = engine.connector.scheduler
    attempts = s.of("reserve", 2)
    assert s.of("reserve", 1) == [(1, 0, 1)]                            # ids count from 1, one per attempt
    assert attempts == [(2, 0, rid) for rid in range(2, 2 + len(attempts))]
    assert len(attempts) == engine.states[2].num_deferrals + 1 == 9
    assert s.of("release", 2) == [(2, rid, 0, 20) for rid in range(2, 2 + len(attempts))]
    assert [(e.reservation_id, e.iteration) for e in log.of(PrefixLoadRetired)] == [(10, 9)]
    assert s.of("ask") == [] and engine.integrity_errors == 0 and engine.stats.failures == []
    released_once(engine, log, s.of("release"))


@pytest.mark.parametrize("promise, early, load", [
    (42, [(40, 42)], (0, 40)),        # the whole prompt: cut at prompt_len - 1 = 41, floored to 40
    (30, [(28, 30)], (0, 28)),        # floored to a block
    (40, [], (0, 40)),                # already whole blocks, a token left: nothing released early
    (3, [(0, 3)], None),              # less than a block: released whole, no load
], ids=["whole-prompt", "mid-block", "exact", "sub-block"])
def test_a_promise_is_clamped_to_the_last_token_and_floored_to_a_block_the_rest_released_at_once(promise, early,
                                                                                                  load):
    spec = reserving(lambda request, n: (promise, False))
    engine = make_engine(spec, num_slots=64, runtime=V2)
    log = logged(engine)
    engine.add_request(Request(1, list(range(42)), 2))
    engine.run()
    s = engine.connector.scheduler
    assert [(e.reservation_id, e.start, e.end) for e in log.of(Reserved)] == [(1, 0, promise)]
    assert s.of("release") == [(1, 1, a, b) for a, b in early + ([load] if load else [])]
    # The cut is released while scheduling, before the pass; the load's range when it retires
    # (a synchronous load reported in its own iteration's get_finished_prefix_loads).
    expected = [("ReservationReleased", a) for a, _ in early] \
        + ([("PrefixLoadRetired", None), ("ReservationReleased", 0)] if load else []) + [("PassDone", None)]
    assert [(type(e).__name__, getattr(e, "start", None)) for e in log.events if e.iteration == 1
            and isinstance(e, (ReservationReleased, PassDone, PrefixLoadRetired))] == expected
    (out, *_) = s.outputs
    assert [(p.start, p.end) for p in out.prefix_loads] == ([load] if load else [])
    first = out.new_requests[0]
    end = load[1] if load else 0
    assert (first.computed_position, first.num_scheduled_tokens) == (0, 42 - end)
    assert engine.states[1].request.py_num_connector_matched_tokens == end
    assert engine.integrity_errors == 0 and engine.stats.failures == []
    released_once(engine, log, s.of("release"))


def test_a_prefix_load_carries_the_reservation_the_pages_the_prompt_and_the_salt():
    # PrefixLoad fields (test_confirmed_async_load_survives_a_second_output_build): the promise
    # starts at the local match (16 tokens request 1 left in the radix tree, same salt).
    spec = reserving(lambda request, n: (16, True) if request.request_id == 2 else (0, False))
    engine = make_engine(spec, num_slots=64, runtime=V2)
    shared = list(range(300, 316))
    engine.add_request(Request(1, shared + [1, 2, 3], 1, cache_salt="tenant"))
    engine.run()
    prompt = shared + list(range(400, 424))                             # 40 tokens
    engine.add_request(Request(2, prompt, 2, cache_salt="tenant"))
    engine.step()
    s = engine.connector.scheduler
    assert s.of("reserve", 2) == [(2, 16, 2)]
    pages = engine.states[2].kv.page_indices_by_group().as_lists()
    out = s.outputs[-1]
    assert out.prefix_loads == [PrefixLoad(2, 2, 16, 32, True, pages, prompt, "tenant")]
    assert out.new_requests == [] and out.cached_requests == []         # loading: out of the batch
    engine.run()
    assert engine.integrity_errors == 0 and engine.stats.failures == []


# ---- completion across ranks, asynchronous loads, cancellation ------------------------------------

@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_a_load_retires_only_once_every_rank_reported_it(is_async):
    # PrefixLoadCompletionTracker: complete once len(workers) == size; rank 1 reports one iteration late.
    spec = reserving(lambda request, n: (32, is_async), lag=lambda rank, rid: rank)
    engine = make_engine(spec, num_slots=64, runtime=V2, num_ranks=2)
    log = logged(engine)
    engine.add_request(Request(1, list(range(40)), 3))
    engine.run()
    assert [w.reported[:3] for w in engine.connector.workers] == [[[1], [], []], [[], [1], []]]
    assert [(e.iteration, e.reservation_id) for e in log.of(PrefixLoadRetired)] == [(2, 1)]
    assert [(e.iteration, e.start, e.end) for e in log.of(ReservationReleased)] == [(2, 0, 32)]
    passes = [(e.iteration, e.items) for e in log.of(PassDone)][:3]
    if is_async:   # out of the batch until the load retired (iteration 2), computed from 32 after
        assert passes == [(1, ()), (2, ()), (3, ((1, 32, 40),))]
        assert [e.iteration for e in log.of(LoadFinished)] == [2]
    else:          # a synchronous load lands in its pass: the request computes on; only the release waits
        assert passes == [(1, ((1, 32, 40),)), (2, ((1, 40, 41),)), (3, ((1, 41, 42),))]
    assert engine.integrity_errors == 0 and engine.stats.failures == []
    released_once(engine, log, engine.connector.scheduler.of("release"))


def test_an_async_prefix_load_keeps_its_request_out_of_the_batch_until_it_retires():
    spec = reserving(lambda request, n: (32, True), lag=lambda rank, rid: 2)
    engine = make_engine(spec, num_slots=64, runtime=V2)
    log = logged(engine)
    engine.add_request(Request(1, list(range(40)), 2))
    engine.run()
    s, (worker,) = engine.connector.scheduler, engine.connector.workers
    assert [(e.iteration, e.items) for e in log.of(PassDone)][:4] == [(1, ()), (2, ()), (3, ()), (4, ((1, 32, 40),))]
    assert [len(out.prefix_loads) for out in s.outputs] == [1, 0, 0]   # no build while nothing is scheduled
    assert (s.outputs[0].new_requests, s.outputs[0].cached_requests) == ([], [])
    first = s.outputs[1].new_requests[0]                                # new, after the load: from 32
    assert (first.request_id, first.computed_position, first.num_scheduled_tokens) == (1, 32, 8)
    assert [(e.iteration, e.reservation_id) for e in log.of(PrefixLoadRetired)] == [(3, 1)]
    # Reservation loads are reported through get_finished_prefix_loads, never as get_finished's loads.
    assert all(call == ([], []) for call in worker.finished_calls)
    assert engine.states[1].request.py_num_connector_matched_tokens == 32
    released_once(engine, log, s.of("release"))


def test_an_abort_during_an_async_prefix_load_keeps_the_allocation_until_the_load_retires():
    # The lifecycle table's row 4: the runtime never aborts a transfer; row 5: once every worker
    # completed, the cancelled request is finalized and its allocation freed.
    spec = reserving(lambda request, n: (32, True), lag=lambda rank, rid: 3)
    engine = make_engine(spec, num_slots=64, runtime=V2)
    log = logged(engine)
    engine.add_request(Request(1, list(range(40)), 3))
    engine.step()
    state = engine.states[1]
    held = engine.manager.num_free_slots(0)
    assert (state.phase, held) == (Phase.TRANSMISSION, 64 - 10)
    engine.abort(1)
    for iteration in (2, 3):
        assert (state.phase, state.kv.status, engine.manager.num_free_slots(0)) \
            == (Phase.TRANSMISSION, KvCacheStatus.ACTIVE, held), iteration
        engine.step()
    engine.step()                                                       # iteration 4: every rank reported
    assert (state.phase, state.failure, engine.manager.num_free_slots(0)) == (Phase.FAILED, FailureReason.ABORTED, 64)
    ends = [(type(e).__name__, e.iteration) for e in log.events
            if isinstance(e, (PrefixLoadRetired, ReservationReleased, Finished))]
    assert ends == [("PrefixLoadRetired", 4), ("ReservationReleased", 4), ("Finished", 4)]
    s = engine.connector.scheduler
    assert s.of("finished") == [(1, list(range(10)))] and s.of("release") == [(1, 1, 0, 32)]
    assert [e.items for e in log.of(PassDone)] == [()] * 4 and engine.is_done()
    released_once(engine, log, s.of("release"))
    check_manager(engine.manager)


def paused_between_two_reservations() -> tuple[Engine, EventLog]:
    """Request 1's first attempt loads synchronously (reservation 1, rank 0 reports it 3 iterations
    late), then it is paused (MAX_UTILIZATION's pause: its allocation destroyed); its replay will
    load asynchronously (reservation 2, reported 5 iterations late)."""
    attempts = []
    spec = reserving(lambda request, n: attempts.append(n) or (32, len(attempts) > 1),
                     lag=lambda rank, rid: {1: 3, 2: 5}[rid])
    engine = make_engine(spec, num_slots=64, runtime=V2, pause_to_grow=True, local_reuse=False)
    log = logged(engine)
    engine.add_request(Request(1, list(range(40)), 6))
    engine.step()
    engine.step()
    engine.pause(engine.states[1])
    return engine, log


def test_a_stale_completion_cannot_resume_a_replayed_request():
    # test_stale_completion_cannot_finish_a_replayed_allocation: request 1's synchronous load
    # (reservation 1, rank 0 reports it 3 iterations late) is followed by a pause (its allocation
    # destroyed) and a replay that loads asynchronously (reservation 2, reported 5 iterations late).
    # Reservation 1's retirement says nothing about reservation 2: the request must wait for it.
    engine, log = paused_between_two_reservations()
    engine.run()
    retired = {e.reservation_id: e.iteration for e in log.of(PrefixLoadRetired)}
    assert retired == {1: 4, 2: 8}
    computed = [e.iteration for e in log.of(PassDone) if e.iteration > 2 and e.items]
    assert computed[0] > retired[2]


def test_run_returns_only_once_every_prefix_load_retired():
    # A synchronous load that rank 0 reports one iteration late, on a request that ends in the
    # iteration of its load: TensorRT-LLM keeps polling (and keeps the promise) until it retires.
    spec = reserving(lambda request, n: (32, False), lag=lambda rank, rid: 1)
    engine = make_engine(spec, num_slots=64, runtime=V2)
    engine.add_request(Request(1, list(range(40)), 1))
    engine.run()
    assert engine.connector.releases == [(1, 1, 0, 32)]


# ---- bring-up ---------------------------------------------------------------------------------

class _NoRelease(ReservingScheduler):
    release_prefix_reservation = KvCacheConnectorScheduler.release_prefix_reservation


class _NoReserve(ReservingScheduler):
    reserve_prefix = KvCacheConnectorScheduler.reserve_prefix


class _NoPrefixLoads(ReportingWorker):
    get_finished_prefix_loads = NoOpWorker.get_finished_prefix_loads


PARTIAL = {"reserve_prefix": (_NoReserve, ReportingWorker),
           "release_prefix_reservation": (_NoRelease, ReportingWorker),
           "worker": (ReservingScheduler, _NoPrefixLoads)}


@pytest.mark.parametrize("missing", list(PARTIAL))
@pytest.mark.parametrize("runtime", list(RuntimeName), ids=str)
def test_a_partial_implementation_is_refused_at_bring_up_on_main_only(runtime, missing):
    # test_partial_reservation_capability_is_rejected: main's V2 refuses; V1 and release never
    # call the hooks, so they run the connector on its get_num_new_matched_tokens.
    scheduler, worker = PARTIAL[missing]
    spec = ConnectorSpec("partial", scheduler, worker, __name__)
    if runtime is V2:
        with pytest.raises(RefusedSetupError, match="prefix reservations require") as refused:
            make_engine(spec, runtime=runtime)
        assert refused.value.blames_connector
        name = missing if missing != "worker" else "get_finished_prefix_loads"
        assert str(refused.value).endswith(f"but not {name}")
        return
    engine = make_engine(spec, runtime=runtime)
    engine.add_request(Request(1, list(range(12)), 2))
    engine.run()
    calls = engine.connector.scheduler.calls
    assert [c for c in calls if c[0] in ("ask", "reserve")] == [("ask", 1, 0)] and engine.stats.failures == []


@pytest.mark.parametrize("runtime", list(RuntimeName), ids=str)
def test_only_main_with_all_three_hooks_reserves(runtime):
    # test_legacy_connectors_do_not_enable_reservations, and the profiles without reservations.
    engine = make_engine(reserving(lambda request, n: (8, False)), runtime=runtime)
    engine.add_request(Request(1, list(range(12)), 2))
    engine.run()
    kinds = [c[0] for c in engine.connector.scheduler.calls if c[0] in ("ask", "reserve")]
    assert kinds == (["reserve"] if runtime is V2 else ["ask"])
    assert isinstance(engine.admission, ReservingAdmission) is (runtime is V2)
    legacy = make_engine(mock_connector().spec, runtime=V2)              # none of the three hooks
    assert isinstance(legacy.admission, FinalBatchAdmission)


# ---- the property ----------------------------------------------------------------------------------

@st.composite
def workloads(draw):
    tpb = draw(st.sampled_from([2, 4]))
    n = draw(st.integers(1, 5))
    prompts = [draw(st.lists(st.integers(1, 6), min_size=1, max_size=30)) for _ in range(n)]
    offers = [(draw(st.integers(0, 34)), draw(st.booleans())) for _ in range(n)]
    new_tokens = [draw(st.integers(1, 4)) for _ in range(n)]
    need = max(-(-(len(p) + t) // tpb) for p, t in zip(prompts, new_tokens, strict=True))
    num_slots = need + draw(st.integers(0, 12))
    lags = draw(st.lists(st.integers(0, 3), min_size=2, max_size=2))
    num_ranks = draw(st.sampled_from([1, 2]))
    pause = draw(st.booleans())
    aborts = draw(st.dictionaries(st.integers(0, n - 1), st.integers(1, 6), max_size=2))
    chunk_size = draw(st.sampled_from([None, 4, 16]))
    return tpb, prompts, offers, new_tokens, num_slots, lags, num_ranks, pause, aborts, chunk_size


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_every_promise_is_released_exactly_once_whatever_the_workload(workload):
    tpb, prompts, offers, new_tokens, num_slots, lags, num_ranks, pause, aborts, chunk_size = workload

    def answer(request, num_computed):
        count, is_async = offers[request.request_id]
        count = min(count, request.prompt_len - num_computed)
        return count, is_async and count > 0

    spec = reserving(answer, lag=lambda rank, rid: lags[rank])
    scheduler = SchedulerConfig(max_num_tokens=64, chunk_size=chunk_size, reserve_outputs=not pause,
                                pause_to_grow=pause)
    config = EngineConfig(KvCacheManagerConfig(load_model("tiny"), tpb, num_slots=num_slots, device="cpu"), scheduler,
                          runtime=V2, num_ranks=num_ranks, check_integrity_every_iteration=True)
    engine = Engine(config, spec)
    for worker in engine.connector.workers:
        worker.fake = engine.fake
    log = logged(engine)
    for i, (prompt, tokens) in enumerate(zip(prompts, new_tokens, strict=True)):
        engine.add_request(Request(i, [t + 10 * (i % 2) for t in prompt], tokens))   # some share prefixes
    try:   # Engine.is_done waits for the last prefix load to retire
        while not engine.is_done() and engine.iteration < 400:
            engine.step()
            for rid, at in aborts.items():
                if at == engine.iteration:
                    engine.abort(rid)
    except OutOfPagesError:   # not a reservation matter (neither admission should get here)
        assume(False)
    assert engine.is_done()
    failed = {int(f.split(":")[0].split()[1]) for f in engine.stats.failures}
    assert failed <= set(aborts), engine.stats.failures
    assert all(engine.states[i].failure is FailureReason.ABORTED for i in failed)
    assert engine.integrity_errors == 0
    released_once(engine, log, engine.connector.scheduler.of("release"))
    assert not engine.admission.book.tracked                            # nothing left in flight
    check_manager(engine.manager)
