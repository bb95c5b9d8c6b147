"""The runtime profiles at their edges: what a review of the first version found, each a test that
failed on it (an abort beside a stale reservation, a follower's failing report, a failed
`build_connector_meta` with a prefix load taken, V1's first chunk at position 0, offers past the
prompt, an empty background load on the release V2)."""

from __future__ import annotations

from kvtool.connector.request import Request
from kvtool.connectors.registry import load_connector
from kvtool.engine.engine import Engine, EngineConfig
from kvtool.engine.events import Finished, PassDone, PrefixLoadRetired
from kvtool.engine.request_state import FailureReason
from kvtool.engine.runtimes import RuntimeName
from kvtool.engine.scheduler import SchedulerConfig
from kvtool.manager import KvCacheManagerConfig
from kvtool.models import load_model
from tests.helpers.engines import make_engine, scripted
from tests.test_prefix_reservations import (
    ReservingScheduler,
    logged,
    paused_between_two_reservations,
    released_once,
    reserving,
)

V1, V2, RELEASE = RuntimeName.TRTLLM_V1, RuntimeName.TRTLLM_V2, RuntimeName.TRTLLM_V2_RELEASE


def test_an_abort_waits_for_the_load_the_request_waits_for_not_an_earlier_attempts():
    # The first attempt's synchronous load (reservation 1) is reported 3 iterations late; after a
    # pause the replay loads asynchronously (reservation 2, 5 late). An abort while the replay waits
    # keeps the allocation until reservation 2 retires, not until reservation 1 does.
    engine, log = paused_between_two_reservations()
    engine.step()                      # the replay reserves anew and parks on reservation 2
    engine.abort(1)
    engine.run()
    retired = {e.reservation_id: e.iteration for e in log.of(PrefixLoadRetired)}
    (ended,) = [e.iteration for e in log.of(Finished) if e.request_id == 1]
    assert retired == {1: 4, 2: 8} and ended == 8
    assert engine.states[1].failure is FailureReason.ABORTED
    released_once(engine, log)


class _RaisingBuild(ReservingScheduler):
    def build_connector_meta(self, scheduler_output):
        if scheduler_output.prefix_loads:
            raise RuntimeError("no metadata today")
        return super().build_connector_meta(scheduler_output)


def test_a_failed_build_fails_the_request_it_parked_and_releases_its_prefix_load_at_once():
    spec = reserving(lambda request, n: (32, True))
    spec = type(spec)(spec.name, type("Raising", (_RaisingBuild,), {"answer": staticmethod(lambda r, n: (32, True))}),
                      spec.worker_class, spec.module)
    engine = make_engine(spec, num_slots=64, runtime=V2, local_reuse=False)
    log = logged(engine)
    engine.add_request(Request(1, list(range(40)), 2))
    engine.run(max_iterations=10)
    assert engine.states[1].failure is FailureReason.CONNECTOR_FAILED_IN_PASS
    assert engine.stats.iterations == 1                     # not left in transmission until a watchdog
    assert engine.connector.releases == [(1, 1, 0, 32)]
    released_once(engine, log)


def test_v1_keeps_the_scheduled_chunk_when_nothing_is_prepopulated():
    # llmRequest.h setPrepopulatedPromptLen floors a chunk's end only when prepopulatedPromptLen > 0
    engine = make_engine(scripted(lambda r, n: (0, False)), runtime=V1, chunk_size=9, local_reuse=False)
    engine.add_request(Request(1, list(range(20)), 1))
    chunks = []
    while not engine.is_done():
        batch = engine.step()
        chunks += [n for s, n in batch.context]
    assert chunks == [9, 9, 2]


def test_v1_floors_the_chunk_after_a_prepopulated_prefix():
    engine = make_engine(scripted(lambda r, n: (5, False)), runtime=V1, chunk_size=9, local_reuse=False)
    log = logged(engine)
    engine.add_request(Request(1, list(range(20)), 1))
    engine.step()
    assert [e.items for e in log.of(PassDone)] == [((1, 5, 12),)]   # [5, 12): its end floored to 3 blocks


def test_an_offer_past_the_prompt_is_refused_on_v1_clamped_on_main_and_handed_back_on_release():
    outcomes = {}
    for runtime in (V1, V2, RELEASE):
        engine = make_engine(scripted(lambda r, n: (99, False)), runtime=runtime, local_reuse=False)
        engine.add_request(Request(1, list(range(20)), 1))
        engine.run()
        state = engine.states[1]
        outcomes[runtime] = (state.failure, state.num_external, [v.check for v in engine.connector.violations],
                             engine.connector.cancels)
    assert outcomes[V1][0] is FailureReason.ASK_REFUSED and outcomes[V1][2] == ["beyond-prompt"]
    assert outcomes[V2] == (None, 19, ["beyond-prompt"], [])              # cut to the last prompt token
    assert outcomes[RELEASE] == (None, 0, ["beyond-prompt"], [(1, 0, 99)])


def test_the_release_v2_leaves_no_background_load_for_a_request_it_does_not_wait_for():
    # host-async's answer is asynchronous; a request whose offer the runtime cancels whole is not
    # parked, and the worker must not hold an empty load for it
    spec = load_connector("host-async")
    engine = make_engine(spec, runtime=RELEASE, local_reuse=True)
    prompt = list(range(1, 18))
    engine.add_request(Request(1, prompt, 1))
    engine.add_request(Request(2, prompt, 1, arrival=1.0))
    engine.run()
    assert engine.connector.workers[0]._loading == {}
    assert all(engine.states[i].failure is None for i in (1, 2))


def test_a_follower_whose_prefix_load_report_raises_fails_the_pass_naming_it():
    spec = load_connector("tests.helpers.rank_connectors:ReservingHostScheduler:PrefixLoadsRaiseOnRank1")
    config = EngineConfig(KvCacheManagerConfig(load_model("tiny"), 4, num_slots=64, device="cpu"),
                          SchedulerConfig(local_reuse=False), runtime=V2, num_ranks=2, ranks_as_processes=True)
    engine = Engine(config, spec)
    try:
        prompt = list(range(1, 30))
        engine.add_request(Request(1, prompt, 2))
        engine.add_request(Request(2, prompt, 2, arrival=1.0))
        engine.run(max_iterations=200)
    finally:
        engine.close()
    assert engine.states[2].failure is FailureReason.CONNECTOR_FAILED_IN_PASS
    assert "get_finished_prefix_loads (rank 1) raised RuntimeError: rank 1 lost its completion queue" \
        in engine.states[2].error
