"""The pass driver calls each worker's hooks as bound when its rank was set up, and tells an
observer around every guarded hook: what watches hooks observes them, it patches no worker."""

from __future__ import annotations

from kvtool.connector.request import Request
from kvtool.engine.request_state import Phase
from tests.helpers.engines import make_engine, scripted


class HookLog:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int]] = []

    def before(self, hook: str, rank: int, args: tuple) -> None:
        self.calls.append(("before", hook, rank))

    def after(self, hook: str, rank: int) -> None:
        self.calls.append(("after", hook, rank))


def _engine_with_one_request(num_ranks: int = 1):
    engine = make_engine(scripted(lambda r, n: (0, False)), num_ranks=num_ranks)
    engine.add_request(Request(1, list(range(10)), 1))
    return engine


def test_the_observer_is_told_before_and_after_every_hook_of_every_rank_in_order():
    engine = _engine_with_one_request(num_ranks=2)
    log = HookLog()
    engine.driver.observe(log)
    engine.step()
    hooks = [hook for when, hook, rank in log.calls if when == "before" and rank == 0]
    num_layers = len(engine.fake.layer_ids)
    assert hooks == (["start_load_kv"] + ["wait_for_layer_load", "save_kv_layer"] * num_layers
                     + ["wait_for_save", "get_finished"])
    assert {rank for _, _, rank in log.calls} == {0, 1}
    assert all(log.calls[i][0] == "before" and log.calls[i + 1][0] == "after" and
               log.calls[i][1:] == log.calls[i + 1][1:] for i in range(0, len(log.calls), 2))


def test_a_hook_changed_on_the_worker_after_setup_is_not_called():
    engine = _engine_with_one_request()
    worker = engine.connector.workers[0]
    patched = []
    worker.start_load_kv = lambda stream: patched.append(stream)
    engine.run()
    assert patched == [] and engine.states[1].phase is Phase.DONE
    assert engine.driver.workers[0].hooks.start_load_kv.__func__ is type(worker).start_load_kv


def test_what_the_observer_raises_before_a_hook_fails_that_hook():
    class FailsTheFirstLoadWait(HookLog):
        def before(self, hook, rank, args):
            super().before(hook, rank, args)
            if hook == "wait_for_layer_load" and not any(c[1] == hook for c in self.calls[:-1]):
                raise RuntimeError("injected")

    engine = _engine_with_one_request()
    engine.driver.observe(FailsTheFirstLoadWait())
    engine.run()
    (failure,) = engine.connector.failures
    assert failure.hook == "wait_for_layer_load (rank 0)" and failure.error.startswith("RuntimeError: injected")
