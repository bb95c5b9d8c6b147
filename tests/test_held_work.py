"""A connector's background work held by kvtool (`kvtool.engine.held_work`, `held_threads`,
`hold_policy`): work started in a hook does not start; it runs at the point the schedule names
(the latest at the default seed), or at once when something waits for it, in start order per pool."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor, wait

import pytest

from kvtool.engine import held_threads
from kvtool.engine.held_work import HeldWork, Release
from kvtool.engine.hold_policy import HoldPoint, HoldPolicy, is_due


class Clock:
    """The engine's iteration, as HeldWork reads it."""

    def __init__(self) -> None:
        self.iteration = 0


@pytest.fixture
def held():
    """A HeldWork at the default seed (every task to NEXT_GATE), installed; its releases listed."""
    clock, releases = Clock(), []
    work = HeldWork(HoldPolicy(), releases.append, lambda: clock.iteration)
    held_threads.install(work)
    try:
        yield work, clock, releases
    finally:
        work.release_all("end")
        held_threads.uninstall(work)


# ---- the policy ----------------------------------------------------------------------------------
def test_next_gate_is_due_only_at_a_later_iterations_gate():
    assert not is_due(HoldPoint.NEXT_GATE, 3, 3, HoldPoint.GATE)
    assert not is_due(HoldPoint.NEXT_GATE, 3, 4, HoldPoint.GET_FINISHED)
    assert is_due(HoldPoint.NEXT_GATE, 3, 4, HoldPoint.GATE)


def test_earlier_points_are_due_at_or_after_their_point_of_the_same_iteration():
    assert is_due(HoldPoint.AFTER_HOOK, 3, 3, HoldPoint.AFTER_HOOK)
    assert not is_due(HoldPoint.GET_FINISHED, 3, 3, HoldPoint.AFTER_HOOK)
    assert is_due(HoldPoint.GET_FINISHED, 3, 3, HoldPoint.GATE)
    assert not is_due(HoldPoint.GATE, 3, 3, HoldPoint.GET_FINISHED)
    assert is_due(HoldPoint.GATE, 3, 4, HoldPoint.AFTER_HOOK)


def test_the_default_seed_holds_every_task_to_the_latest_point_and_other_seeds_draw_each():
    latest = HoldPolicy().points()
    assert [latest.next() for _ in range(5)] == [HoldPoint.NEXT_GATE] * 5
    first, again = HoldPolicy(7, latest=False).points(), HoldPolicy(7, latest=False).points()
    drawn = [first.next() for _ in range(200)]
    assert drawn == [again.next() for _ in range(200)]          # one seed, one schedule
    assert set(drawn) == set(HoldPoint)                         # earliest to latest


# ---- pool tasks ----------------------------------------------------------------------------------
def test_a_pool_task_started_in_a_hook_runs_at_the_next_iterations_gate(held):
    work, clock, releases = held
    ran: list[int] = []
    with ThreadPoolExecutor(1) as pool:
        with work.hook("start_load_kv"):
            future = pool.submit(ran.append, 1)
        work.at_point(HoldPoint.GATE)             # its own iteration's gate: still held
        assert (ran, future.done(), work.num_held) == ([], False, 1)
        clock.iteration = 1
        with work.hook("get_finished"):
            pass
        assert ran == []                          # the next iteration's get_finished: still held
        work.at_point(HoldPoint.GATE)
        assert (ran, future.done(), work.num_held) == ([1], True, 0)
    assert releases == [Release("start_load_kv", 0, 1, "NEXT_GATE")]


def test_waiting_for_a_held_future_runs_it_and_the_tasks_started_before_it_in_order(held):
    work, _, releases = held
    ran: list[str] = []
    with ThreadPoolExecutor(2) as pool:
        with work.hook("save_kv_layer"):
            first, second = pool.submit(ran.append, "first"), pool.submit(ran.append, "second")
            third = pool.submit(ran.append, "third")
            assert second.result() is None        # waited in the hook: runs now, after `first`
            assert (ran, third.done()) == (["first", "second"], False)
        done, _ = wait([third])                   # concurrent.futures.wait releases it too
        assert done == {third} and first.done()
    assert ran == ["first", "second", "third"]
    assert [r.reason for r in releases] == ["waited"] * 3


def test_the_runtimes_own_calls_outside_a_hook_are_not_held(held):
    work, _, releases = held
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(lambda: 5).result(timeout=5) == 5
    assert (work.num_held, releases) == (0, [])


def test_shutting_a_pool_down_runs_its_held_work_first(held):
    work, _, releases = held
    ran: list[int] = []
    pool = ThreadPoolExecutor(1)
    with work.hook("wait_for_save"):
        pool.submit(ran.append, 1)
        pool.submit(ran.append, 2)
    pool.shutdown(wait=True)
    assert ran == [1, 2] and work.num_held == 0
    assert [r.hook for r in releases] == ["wait_for_save", "wait_for_save"]


# ---- threads -------------------------------------------------------------------------------------
def test_a_thread_started_in_a_hook_is_alive_but_runs_only_when_joined(held):
    work, _, releases = held
    ran: list[str] = []
    thread = threading.Thread(target=ran.append, args=("copy",), daemon=True)
    with work.hook("start_load_kv"):
        thread.start()
    assert (ran, thread.is_alive(), work.num_held) == ([], True, 1)
    thread.join(timeout=5)
    assert (ran, thread.is_alive(), work.num_held) == (["copy"], False, 0)
    assert releases == [Release("start_load_kv", 0, 0, "waited")]


def test_work_a_connector_thread_starts_is_held_too_and_idle_runs_everything(held):
    work, _, releases = held
    ran: list[str] = []
    with ThreadPoolExecutor(1) as pool:
        outer = threading.Thread(target=lambda: pool.submit(ran.append, "inner"), daemon=True)
        with work.hook("start_load_kv"):
            outer.start()
        assert work.release_all("idle") == 1       # the outer thread ran; it held what it submitted
        assert (ran, work.num_held) == ([], 1)
        assert work.release_all("idle") == 1
        assert ran == ["inner"]
    assert [(r.hook, r.reason) for r in releases] == [("start_load_kv", "idle"), ("a connector thread", "idle")]
