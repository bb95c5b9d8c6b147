"""The ends of requests (`engine.lifecycle`) and the one table of pages held for asynchronous saves;
the rank pass rank 0 runs (`engine.rank_group`), the same as a follower's; the engine layer's files
stay short."""

from __future__ import annotations

from pathlib import Path

from kvtool.connector.request import Request
from kvtool.engine.events import Paused, SaveFinished
from kvtool.engine.fake_engine import FakeEngine
from kvtool.engine.lifecycle import SaveHolds
from kvtool.engine.pass_driver import PassDriver, PassPlan
from kvtool.engine.pass_types import PassItem
from kvtool.engine.rank_group import LocalRankGroup
from kvtool.engine.rank_orders import FinishedOrder, PassOrder
from kvtool.engine.rank_pass import RankPass
from kvtool.engine.request_state import Phase
from kvtool.engine.worker_setup import forward_stream
from kvtool.manager.integrity import check_manager
from tests.helpers.engines import make_engine, scripted
from tests.helpers.managers import make_manager

ENGINE_DIR = Path(__file__).parent.parent / "kvtool" / "engine"
MAX_LINES = 350


def test_a_hold_lasts_until_its_request_is_released_and_every_hold_of_it_goes_then():
    manager = make_manager("tiny", 4, num_slots=8)
    first, second = manager.create_kv_cache(1, []), manager.create_kv_cache(2, [])
    for kv in (first, second):
        kv.resume()
        assert kv.resize(8)
    holds = SaveHolds(manager)
    holds.keep(7, first)
    holds.keep(7, second)
    first.close()
    second.close()
    assert 7 in holds and len(manager.holds) == 2 and manager.num_free_slots(0) == 4
    holds.release(7)
    assert 7 not in holds and manager.holds == [] and manager.num_free_slots(0) == 8
    holds.release(7)                      # nothing left: a second report changes nothing
    assert manager.num_free_slots(0) == 8


def test_a_paused_requests_asynchronous_save_holds_its_pages_until_it_is_reported():
    engine = make_engine(scripted(lambda r, n: (0, False), finish_async=True), num_slots=12, pause_to_grow=True)
    held_at_pause = []
    engine.events.subscribe(lambda e: held_at_pause.append(len(engine.manager.holds)) if isinstance(e, Paused)
                            else None)
    for i in range(4):
        engine.add_request(Request(i, [i * 100 + t for t in range(10)], 12))
    engine.run()
    assert engine.stats.num_pauses == len(held_at_pause) > 0 and all(n >= 1 for n in held_at_pause)
    assert all(engine.states[i].phase is Phase.DONE for i in range(4)) and engine.integrity_errors == 0
    assert engine.manager.holds == [] and not any(i in engine.lifecycle.holds for i in range(4))
    check_manager(engine.manager)


def test_a_finished_requests_save_ends_it_once_reported():
    engine = make_engine(scripted(lambda r, n: (0, False), finish_async=True))
    saved = []
    engine.events.subscribe(lambda e: saved.append(e.request_id) if isinstance(e, SaveFinished) else None)
    engine.add_request(Request(1, list(range(10)), 1))
    engine.run()
    assert saved == [1] and engine.states[1].phase is Phase.DONE and engine.manager.holds == []


def test_rank_zeros_group_writes_received_contexts_and_verifies_the_idle_pages_it_is_sent():
    manager = make_manager("tiny", 4, num_slots=8)
    fake = FakeEngine(manager.layout, manager.layer_groups, 0)
    driver = PassDriver([], fake.layer_ids, fake.forward_layer, forward_stream(manager.device),
                        lambda hook, fn, *args: (True, fn(*args)))
    group = LocalRankGroup(RankPass(0, fake, driver), num_ranks=1)
    written = PassItem(5, list(range(1, 10)), [[0, 1, 2]], 0, 9, False)
    assert group.run_pass(PassOrder(1, None, [], [written], [], PassPlan(False, True), [written])).ok
    assert fake.num_integrity_errors == 0
    manager.poison_slot(0, 1)             # a stray write into an idle request's page
    assert group.run_pass(PassOrder(2, None, [], [], [], PassPlan(False, True), [written])).ok
    assert fake.errors_by_request[5] > 0 and {i.block_ordinal for i in fake.issues} == {1}
    assert group.finish(FinishedOrder([], [], [], [5])).answers == {}


def test_no_engine_module_is_longer_than_the_limit():
    long = {p.name: n for p in ENGINE_DIR.glob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"modules of kvtool/engine over {MAX_LINES} lines: {long}"
