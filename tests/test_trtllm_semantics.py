"""TensorRT-LLM's own connector unit-test semantics, as tests of kvtool's runtime.

Ported as facts from TensorRT-LLM's tests/unittest/_torch/executor/test_connector.py (the V2 KV
cache manager, overlap scheduler off); kvtool's names for the same moments are given per test.
Already tests elsewhere, and so not repeated here: a neither-form scheduler refused
(test_trtllm_parity.py::test_a_connector_implementing_neither_form_still_fails_at_construction),
the committed amount after a clamp or an overtaking local match (test_trtllm_parity.py), the replay
after a destroyed allocation reported new and whole (test_trtllm_parity.py, test_pause.py), every
rank's save report awaited through the engine (test_runtime.py, test_ranks.py), 1 + K scheduled
tokens seen at all (test_drafts.py). What follows are the parts of those facts no test held yet.
"""

from __future__ import annotations

import pytest

from kvtool.connector.api import KvCacheConnectorScheduler, KvCacheConnectorWorker
from kvtool.connector.loader import ConnectorSpec
from kvtool.connector.request import Request
from kvtool.connector.runtime import ConnectorRuntime
from kvtool.errors import ConstructionError
from kvtool.group_pages import GroupPages
from tests.helpers.connectors import NoOpWorker, OracleWorker, ScriptedScheduler
from tests.helpers.engines import make_engine, sched, scripted
from tests.helpers.mock_connector import mock_connector

_PAGES = GroupPages([[0, 1]])


def _runtime(num_ranks: int, finish_async: bool = True) -> ConnectorRuntime:
    mc = mock_connector(finish_async=finish_async)
    return ConnectorRuntime(mc.spec.scheduler_class(None), [], num_ranks)


def _poll(runtime: ConnectorRuntime, *answers: tuple[list[int], list[int]]) -> tuple[list[int], list[int]]:
    """One `get_finished` round: rank i answers `answers[i]`; the ids complete on every rank."""
    saved, loaded, ok = runtime.collect_finished({rank: (True, answer) for rank, answer in enumerate(answers)})
    assert ok
    return saved, loaded


# ---- a completion counts only when every rank reported it --------------------------------------

@pytest.mark.parametrize("what", ["save", "load"])
def test_a_completion_counts_once_the_last_rank_reports_it_even_in_a_later_poll(what):
    # TRT-LLM: test_connector_manager_get_finished_allgather (two ranks, request 42).
    runtime = _runtime(num_ranks=2)
    request = Request(42, list(range(8)), 1)
    if what == "save":
        assert runtime.finish(request, _PAGES) == (True, True)
    else:
        runtime.start_async_load(42)
    given = ([42], []) if what == "save" else ([], [42])
    assert runtime.ids_to_report() == given
    assert _poll(runtime, ([], []), ([], [])) == ([], [])          # nobody is done yet
    assert runtime.ids_to_report() == ([], [])                     # an id is handed out once only
    assert _poll(runtime, given, ([], [])) == ([], [])              # rank 1 still busy
    assert 42 in (runtime.pending_saves if what == "save" else runtime.pending_loads)
    assert _poll(runtime, ([], []), given) == given                 # rank 1 catches up: complete
    assert _poll(runtime, ([], []), ([], [])) == ([], [])          # and never again
    assert runtime.pending_saves == runtime.pending_loads == set() and runtime.violations == []


def test_a_completion_only_some_ranks_report_never_counts():
    runtime = _runtime(num_ranks=3)
    assert runtime.finish(Request(7, list(range(8)), 1), _PAGES) == (True, True)
    runtime.ids_to_report()
    nothing = ([], [])
    assert _poll(runtime, ([7], []), nothing, nothing) == ([], [])      # rank 0 done
    assert _poll(runtime, nothing, ([7], []), nothing) == ([], [])      # rank 1 done; rank 2 never
    assert _poll(runtime, nothing, nothing, nothing) == ([], [])
    assert runtime.pending_saves == {7}


# ---- the ask is free of side effects; the runtime may take fewer tokens than offered -----------

def test_the_ask_records_nothing_the_delivery_does():
    # TRT-LLM: test_connector_manager_query_is_side_effect_free (query, then commit).
    mc = mock_connector(matched=(16, True))
    runtime = ConnectorRuntime(mc.spec.scheduler_class(None), [], 2)
    request = Request(42, list(range(64)), 1)
    answer = runtime.ask(request, 32)
    assert (answer.num_tokens, answer.is_async) == (16, True)
    assert mc.scheduler.get_num_new_matched_tokens.call_count == 1
    assert runtime.ids_to_report() == ([], []) and runtime.pending_loads == set()
    assert (runtime.num_async_loads, runtime.cancels, request.py_num_connector_matched_tokens) == (0, [], 0)


def test_an_asked_request_that_is_deferred_has_nothing_recorded_until_it_is_delivered():
    # B (request 2) is offered 12 tokens asynchronously at local match 0 and deferred (no pages);
    # A then commits their shared 8 tokens, so B is delivered 12 - 8 = 4: the runtime takes fewer.
    spec = scripted(lambda r, n: (12, True) if r.request_id == 2 else (0, False))
    engine = make_engine(spec, num_slots=7)
    shared = [5, 6, 7, 8, 9, 10, 11, 12]
    engine.add_request(Request(1, shared + list(range(200, 208)), 1))
    engine.add_request(Request(2, shared + list(range(300, 308)), 1))
    engine.step()
    b = engine.states[2]
    assert b.asked and b.num_deferrals == 1
    assert (b.request.py_num_connector_matched_tokens, engine.connector.num_async_loads) == (0, 0)
    assert engine.connector.pending_loads == set() and sched(engine).cancels() == []
    engine.run()
    assert sched(engine).asks(2) == [("ask", 2, 0)] and sched(engine).cancels() == [(2, 0, 8)]
    assert (b.request.py_num_connector_matched_tokens, engine.connector.num_async_loads) == (4, 1)
    assert engine.integrity_errors == 0 and engine.stats.failures == []


def test_an_async_offer_of_the_whole_prompt_is_taken_one_token_short():
    # TRT-LLM: test_connector_manager_commits_only_what_is_honoured, with the clamp's reason.
    mc = mock_connector(matched=(16, True), echo_finished=True)
    engine = make_engine(mc.spec, tpb=4, num_slots=16)
    engine.add_request(Request(1, list(range(16)), 2))
    engine.run()
    assert [c.args[1:] for c in mc.scheduler.cancel_load.call_args_list] == [(15, 16)]
    assert engine.states[1].request.py_num_connector_matched_tokens == 15
    assert [c.args for c in mc.worker.get_finished.call_args_list][0] == ([], [1])
    assert engine.stats.failures == []


# ---- a reset request is reported as new, with its whole block list ------------------------------

def test_a_replayed_request_is_new_with_exactly_its_replay_pages_and_absent_from_cached():
    # TRT-LLM: test_scheduler_output_resets_a_destroyed_allocation; kvtool destroys the allocation
    # by pausing the request started last (V2 under MAX_UTILIZATION), see test_pause.py.
    engine = make_engine(scripted(lambda r, n: (0, False)), num_slots=12, pause_to_grow=True)
    for i in range(4):
        engine.add_request(Request(i, [i * 100 + t for t in range(10)], 12))
    engine.run()
    allocs = [c[2][0] for c in sched(engine).calls if c[:2] == ("alloc", 3)]
    reports = [out for out in sched(engine).outputs if any(d.request_id == 3 for d in out.new_requests)]
    assert len(allocs) == len(reports) == 2                      # the first run and the replay
    replay_out = reports[1]
    (replay,) = [d for d in replay_out.new_requests if d.request_id == 3]
    assert all(d.request_id != 3 for d in replay_out.cached_requests)
    assert replay.new_block_ids == allocs[1] and replay.new_block_ids_by_layer_group == [allocs[1]]
    assert replay.computed_position == 0 and len(replay.new_tokens) == 10 + 3   # prompt + generated
    assert engine.states[3].request.generated_token_ids[:3] == replay.new_tokens[10:]


# ---- num_scheduled_tokens is 1 + draft length -------------------------------------------------

class _DraftRecorder(ScriptedScheduler):
    """Records, for every generation report, (num_scheduled_tokens, drafts the request carries)."""

    seen: list[tuple[int, int]] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self._requests[request.request_id] = request
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def build_connector_meta(self, scheduler_output):
        for data in scheduler_output.cached_requests:
            request = self._requests[data.request_id]
            if request.num_generated_tokens:   # a decode step (a prefill chunk has generated none)
                _DraftRecorder.seen.append((data.num_scheduled_tokens, len(request.py_draft_tokens)))
        return super().build_connector_meta(scheduler_output)


def test_a_generation_report_schedules_one_token_plus_the_requests_drafts():
    # TRT-LLM: test_scheduler_output_num_scheduled_tokens_with_mtp (1 + get_draft_token_length).
    _DraftRecorder.seen = []
    engine = make_engine(ConnectorSpec("drafts", _DraftRecorder, OracleWorker, __name__), draft_tokens=3,
                         acceptance=0.7)
    for i in range(3):
        engine.add_request(Request(i, [i * 100 + t for t in range(10)], 20))
    engine.run()
    seen = _DraftRecorder.seen
    assert seen and all(scheduled == 1 + drafts for scheduled, drafts in seen)
    assert {drafts for _, drafts in seen} >= {0, 3}                # full drafts and the last steps' none
    assert engine.integrity_errors == 0


# ---- neither the flat nor the grouped form: TypeError at construction --------------------------

class _NeitherSchedulerForm(KvCacheConnectorScheduler):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def build_connector_meta(self, scheduler_output):
        return None


class _NeitherWorkerForm(KvCacheConnectorWorker):
    def start_load_kv(self, stream):
        pass

    def wait_for_layer_load(self, layer_idx, stream):
        pass

    def save_kv_layer(self, layer_idx, stream):
        pass

    def wait_for_save(self, stream):
        pass

    def get_finished(self, finished_gen_req_ids, started_loading_req_ids):
        return [], []


def test_a_scheduler_with_neither_form_is_refused_naming_both_flat_hooks():
    with pytest.raises(TypeError) as refused:
        _NeitherSchedulerForm(llm_args=None)
    assert "request_finished" in str(refused.value) and "update_state_after_alloc" in str(refused.value)


def test_a_worker_with_neither_registration_form_is_refused_naming_register_kv_caches():
    with pytest.raises(TypeError, match="register_kv_caches"):
        _NeitherWorkerForm(llm_args=None)


def test_the_engine_refuses_either_at_construction_before_any_request():
    for spec in (ConnectorSpec("neither", _NeitherSchedulerForm, NoOpWorker, __name__),
                 ConnectorSpec("neither", ScriptedScheduler, _NeitherWorkerForm, __name__)):
        with pytest.raises(ConstructionError, match="could not be constructed: TypeError: Can't instantiate"):
            make_engine(spec)
