"""The runtime's obligations towards a connector: one ask, exact cancel ranges, reserve, deliver."""

from __future__ import annotations

import pytest

from kvtool.connector.loader import ConnectorSpec
from kvtool.connector.request import Request
from kvtool.engine.engine import Engine, EngineConfig
from kvtool.engine.request_state import FailureReason, Offer, Phase
from kvtool.errors import ConnectorError, InputError, IterationLimitError, LogicError
from kvtool.manager import KvCacheManagerConfig
from kvtool.manager.integrity import check_manager
from kvtool.models import load_model
from kvtool.types import BAD_PAGE_INDEX
from tests.helpers.connectors import NoOpWorker, OracleWorker, ScriptedScheduler
from tests.helpers.engines import make_engine, sched, scripted

B = BAD_PAGE_INDEX


def test_the_clamp_cancels_the_tail_and_loads_the_rest():
    engine = make_engine(scripted(lambda r, n: (r.prompt_len - n, False)))
    engine.add_request(Request(1, list(range(12)), 2))
    engine.run()
    state = engine.states[1]
    assert sched(engine).asks() == [("ask", 1, 0)]
    assert sched(engine).cancels() == [(1, 11, 12)]
    assert (state.num_external, state.phase) == (11, Phase.DONE)
    assert engine.stats.computed_tokens == 1 + 1   # the last prompt position, one generation step
    assert engine.integrity_errors == 0


def test_reserve_failure_cancels_the_offer_and_computes_locally():
    spec = scripted(lambda r, n: (11, False) if r.request_id == 2 else (0, False))
    engine = make_engine(spec, num_slots=3, chunk_size=4)
    engine.add_request(Request(1, list(range(100, 108)), 1))
    engine.add_request(Request(2, list(range(12)), 1))
    engine.run()
    assert sched(engine).cancels() == [(2, 0, 11)]
    assert engine.states[2].num_external == 0 and engine.states[2].phase is Phase.DONE
    assert engine.integrity_errors == 0


def overtaking_engine(**kwargs):
    """B is asked (local match 0), reserves, then is deferred; A commits B's first 8 tokens."""
    spec = scripted(lambda r, n: (12, False) if r.request_id == 2 else (0, False))
    engine = make_engine(spec, num_slots=7, **kwargs)
    shared = [5, 6, 7, 8, 9, 10, 11, 12]
    engine.add_request(Request(1, shared + [200, 201, 202, 203, 204, 205, 206, 207], 1))
    engine.add_request(Request(2, shared + [300, 301, 302, 303, 304, 305, 306, 307], 1))
    return engine


def test_deferral_keeps_one_ask_and_the_overtaken_head_is_cancelled():
    engine = overtaking_engine()
    engine.step()
    b = engine.states[2]
    assert b.phase is Phase.WAITING and b.asked and b.num_deferrals == 1 and b.kv is None
    assert b.offer == Offer(0, 12, False)
    engine.run()
    assert sched(engine).asks(2) == [("ask", 2, 0)]
    assert sched(engine).cancels() == [(2, 0, 8)]
    assert (b.num_local_hit, b.num_external) == (8, 4)
    assert engine.integrity_errors == 0


def test_free_before_delivery_cancels_the_whole_offer():
    engine = overtaking_engine()
    engine.step()
    engine.abort(2)
    assert sched(engine).cancels() == [(2, 0, 12)]
    assert engine.states[2].phase is Phase.FAILED and engine.states[2].error == "aborted"
    assert engine.states[2].failure is FailureReason.ABORTED
    assert [c for c in sched(engine).calls if c[0] == "finished" and c[1] == 2]
    engine.run()
    check_manager(engine.manager)


def test_reserve_moves_capacity_and_history_together_and_turns_scratch_reuse_off():
    spec = scripted(lambda r, n: (24, False))
    engine = make_engine(spec, model="tiny-vswa", num_slots=32)
    engine.add_request(Request(1, list(range(30)), 1))
    seen = {}

    def capture(state, budget, admits, original=engine.admission.first_chunk):
        n = original(state, budget, admits)
        seen.update(capacity=state.kv.capacity, history=state.kv.history_length,
                    scratch=state.kv.scratch_reuse, pages=state.kv.get_page_indices(0))
        return n

    engine.admission.first_chunk = capture
    engine.step()
    assert (seen["history"], seen["scratch"]) == (24, False)
    assert seen["capacity"] == 30            # resized to 24 + the 6-token chunk after the reserve
    # window 8 at history 24: blocks 0..3 are stale and got no page
    assert seen["pages"][:4] == [B] * 4 and B not in seen["pages"][4:]
    engine.run()
    assert engine.integrity_errors == 0


def test_recorded_tokens_must_fit_below_the_position():
    engine = overtaking_engine()
    engine.step()
    state = engine.states[2]
    state.kv = engine.manager.create_kv_cache(99, [])
    state.kv.resume()
    state.position = 3      # a broken scheduler state: 12 external tokens cannot sit below position 3
    with pytest.raises(LogicError, match="recorded 12 external tokens at position 3"):
        engine.admission._deliver(state, engine.scheduler.schedule([], [], 2), 2)


def test_async_load_keeps_the_request_out_of_the_batch():
    engine = make_engine(scripted(lambda r, n: (8, True)))
    engine.connector.workers[0].delay = 3
    engine.add_request(Request(1, list(range(12)), 2))
    phases, in_batch = [], []
    while not engine.is_done():
        batch = engine.step()
        phases.append(engine.states[1].phase)
        in_batch.append(any(s.request_id == 1 for s, _ in batch.context) or
                        any(s.request_id == 1 for s in batch.generation))
    # loaded is reported by the third get_finished; the request joins the batch in the next iteration
    assert phases[:3] == [Phase.TRANSMISSION, Phase.TRANSMISSION, Phase.CONTEXT] and not any(in_batch[:3])
    assert in_batch[3] and engine.states[1].phase is Phase.DONE
    worker = engine.connector.workers[0]
    assert worker.finished_calls[0] == ([], [1]) and all(c[1] == [] for c in worker.finished_calls[1:])
    assert engine.integrity_errors == 0


def test_a_stuck_async_load_fails_the_request_instead_of_hanging():
    engine = make_engine(scripted(lambda r, n: (8, True)), max_transmission_iterations=5)
    engine.connector.workers[0].delay = 10_000
    engine.add_request(Request(1, list(range(12)), 2))
    engine.run(max_iterations=50)
    assert engine.states[1].phase is Phase.FAILED and engine.states[1].failure is FailureReason.STUCK_IN_TRANSMISSION
    assert engine.states[1].error.startswith("stuck in transmission: for more than")


def test_vswa_page_lists_are_aligned_and_the_flat_list_is_empty():
    engine = make_engine(scripted(lambda r, n: (20, False)), model="tiny-vswa", num_slots=32)
    engine.add_request(Request(1, list(range(30)), 1))
    engine.run()
    (alloc,) = [c for c in sched(engine).calls if c[0] == "alloc"]
    assert not [c for c in sched(engine).calls if c[0] == "alloc_flat"]   # several groups: no flat call
    lists = alloc[2]
    assert len(lists) == 2 and len(lists[0]) == len(lists[1]) == 8      # position = layer group id
    assert lists[0][:3] == [B, B, B] and B not in lists[1]  # stale at 20 in the window-8 group
    (data,) = sched(engine).outputs[0].new_requests
    assert data.new_block_ids == [] and data.new_block_ids_by_layer_group == lists
    assert type(data.new_block_ids_by_layer_group) is list and type(data.new_block_ids_by_layer_group[0]) is list
    assert data.computed_position == 0 and data.num_scheduled_tokens == 10
    assert engine.integrity_errors == 0


def test_chunked_prefill_reports_append_deltas():
    engine = make_engine(scripted(lambda r, n: (0, False)), chunk_size=4)
    engine.add_request(Request(1, list(range(16)), 2))
    engine.run()
    reports = [(d, new) for out in sched(engine).outputs
               for new, datas in ((True, out.new_requests), (False, out.cached_requests)) for d in datas]
    first, *rest = reports
    assert first[1] and first[0].new_tokens == list(range(16)) and first[0].new_block_ids == [0]
    assert [d.new_block_ids for d, _ in rest] == [[1], [2], [3], [4]]
    assert [d.computed_position for d, _ in reports] == [0, 4, 8, 12, 16]
    assert [d.num_scheduled_tokens for d, _ in reports] == [4, 4, 4, 4, 1]
    assert rest[-1][0].new_tokens == engine.states[1].request.generated_token_ids[:1]
    (alloc,) = [c for c in sched(engine).calls if c[0] == "alloc"]
    assert alloc[2] == [[0]]   # update_state_after_alloc covers the first chunk only


def test_request_finished_receives_the_page_indices():
    engine = make_engine(scripted(lambda r, n: (0, False)))
    engine.add_request(Request(1, list(range(10)), 3))
    final = []

    def spy(state, original=engine.lifecycle.finish):
        final.extend(list(p) for p in state.kv.page_indices_by_group())
        original(state)

    engine.lifecycle.finish = spy
    engine.run()
    (finished,) = [c for c in sched(engine).calls if c[0] == "finished"]
    assert finished[2] == final == [[0, 1, 2]]
    (flat,) = [c for c in sched(engine).calls if c[0] == "finished_flat"]
    assert flat[2] == [0, 1, 2]


class LateOnRankOne(OracleWorker):
    """Rank 1 reports its saves only from its fourth `get_finished` on."""

    def __init__(self, llm_args) -> None:
        super().__init__(llm_args)
        self.rank = llm_args.rank
        self.delayed: list[int] = []

    def get_finished(self, finished, loading):
        saved, loaded = super().get_finished(finished, loading)
        if self.rank != 1:
            return saved, loaded
        self.delayed.extend(saved)
        return ([] if len(self.delayed) and len(self.finished_calls) < 4 else sorted(set(self.delayed))), loaded


def test_async_save_holds_pages_until_every_rank_reports():
    engine = make_engine(scripted(lambda r, n: (0, False), finish_async=True, worker=LateOnRankOne), num_ranks=2)
    engine.add_request(Request(1, list(range(10)), 1))
    engine.step()
    state = engine.states[1]
    assert state.phase is Phase.SAVING and len(engine.manager.holds) == 1
    engine.step()
    assert state.phase is Phase.SAVING   # rank 0 reported, rank 1 not yet
    engine.run()
    assert state.phase is Phase.DONE and engine.manager.holds == []
    check_manager(engine.manager)


def test_get_finished_ids_never_given_are_violations():
    class Liar(OracleWorker):
        def get_finished(self, finished, loading):
            return [77], [78]

    engine = make_engine(scripted(lambda r, n: (0, False), worker=Liar))
    engine.add_request(Request(1, list(range(6)), 1))
    engine.run()
    assert {v.check for v in engine.connector.violations} == {"unknown-save-id", "unknown-load-id"}


def test_generation_only_and_dummy_requests_are_never_asked():
    engine = make_engine(scripted(lambda r, n: (0, False)), pad_generation_batch_to=4)
    engine.add_request(Request(1, list(range(10)), 3))
    engine.add_request(Request(2, list(range(50, 60)), 3, is_generation_only=True))
    engine.run()
    assert [c[1] for c in sched(engine).asks()] == [1]
    reported = {d.request_id for out in sched(engine).outputs for d in out.new_requests + out.cached_requests}
    assert reported == {1, 2}
    assert engine.states[2].phase is Phase.DONE and engine.integrity_errors == 0


def test_dummy_requests_are_forgotten_after_their_pass():
    """Padding dummies get fresh ids every step: the fake engine must not keep a digest per dummy."""
    engine = make_engine(scripted(lambda r, n: (0, False)), pad_generation_batch_to=4)
    engine.add_request(Request(1, list(range(10)), 40))
    seen = []
    engine.run(on_iteration=lambda e: seen.append(len(e.fake._hashes)))
    assert len(seen) == 40 and max(seen) <= 1 and engine.fake._hashes == {}


def test_request_phases_move_only_along_the_life_cycle():
    engine = make_engine(scripted(lambda r, n: (0, False)))
    state = engine.add_request(Request(1, list(range(10)), 2))
    with pytest.raises(LogicError, match="waiting -> generation is not a transition"):
        state.start_generation()
    with pytest.raises(AttributeError):
        state.phase = Phase.DONE        # type: ignore[misc]
    engine.run()
    assert state.phase is Phase.DONE
    with pytest.raises(LogicError, match="done -> context"):
        state.load_landed()


def test_a_hook_that_raises_fails_only_that_request():
    class Raising(ScriptedScheduler):
        def update_state_after_alloc_by_layer_group(self, request, by_group):
            if request.request_id == 2:
                raise RuntimeError("boom")
            super().update_state_after_alloc_by_layer_group(request, by_group)

    spec = ConnectorSpec("raising", Raising, OracleWorker, "tests")
    engine = make_engine(spec)
    for i in range(1, 4):
        engine.add_request(Request(i, list(range(i * 10, i * 10 + 9)), 2))
    engine.run()
    assert [engine.states[i].phase for i in (1, 2, 3)] == [Phase.DONE, Phase.FAILED, Phase.DONE]
    assert engine.states[2].error == "update_state_after_alloc raised"
    assert engine.states[2].failure is FailureReason.ALLOC_HOOK_RAISED
    assert engine.connector.failures[0].request_id == 2 and "boom" in engine.connector.failures[0].error
    assert engine.integrity_errors == 0 and engine.manager.caches == []


@pytest.mark.parametrize("answer, check", [
    ((0, True), "zero-async"), ((-3, False), "negative-count"), ((99, False), "beyond-prompt"),
    ((1.5, False), "answer-shape"), (5, "answer-shape"),
])
def test_answers_that_break_the_contract_are_recorded_and_ignored(answer, check):
    engine = make_engine(scripted(lambda r, n, a=answer: a))
    engine.add_request(Request(1, list(range(10)), 1))
    engine.run()
    assert [v.check for v in engine.connector.violations] == [check]
    assert engine.states[1].phase is Phase.DONE and engine.states[1].num_external == 0


def test_a_lower_cache_tier_is_rejected_naming_both_settings():
    config = EngineConfig(KvCacheManagerConfig(load_model("tiny"), 4, num_slots=8, device="cpu",
                                               host_cache_bytes=1 << 20))
    with pytest.raises(ConnectorError, match="host cache size.*disk cache size"):
        Engine(config, scripted(lambda r, n: (0, False)))


class _TensorOnly(NoOpWorker):
    """A worker written for single-tensor runtimes: it never heard of layouts."""

    tensors = []

    def register_kv_caches(self, kv_cache_tensor):
        _TensorOnly.tensors.append(kv_cache_tensor)


def test_a_tensor_only_worker_gets_the_pool_for_a_single_region_layout():
    _TensorOnly.tensors.clear()
    make_engine(scripted(lambda r, n: (0, False), worker=_TensorOnly), num_slots=8)
    (tensor,) = _TensorOnly.tensors
    # TensorRT-LLM's pool
    assert tuple(tensor.shape) == (8, 4, 2, 4 * 2 * 16) and str(tensor.dtype) == "torch.bfloat16"


def test_a_tensor_only_worker_gets_the_actionable_error_for_vswa():
    with pytest.raises(InputError,
                       match="does not implement register_kv_cache_layout, and this KV cache is not one pool"):
        make_engine(scripted(lambda r, n: (0, False), worker=_TensorOnly), model="tiny-vswa")


class _PassCounting(OracleWorker):
    """Counts end-of-pass calls, and remembers what had happened when each came."""

    def __init__(self, llm_args) -> None:
        super().__init__(llm_args)
        self.hooks: list[str] = []

    def register_forward_pass_callable(self):
        self.hooks.append("register")
        return lambda: self.hooks.append("end-of-pass")

    def save_kv_layer(self, layer_idx, stream):
        self.hooks.append(f"save {layer_idx}")

    def wait_for_save(self, stream):
        self.hooks.append("wait_for_save")


def test_the_forward_pass_callable_runs_once_per_pass_after_the_last_layer():
    engine = make_engine(scripted(lambda r, n: (0, False), worker=_PassCounting), num_ranks=2)
    engine.add_request(Request(1, list(range(10)), 3))
    engine.run()
    for worker in engine.connector.workers:
        assert worker.hooks[0] == "register" and worker.hooks.count("register") == 1
        assert worker.hooks.count("end-of-pass") == engine.stats.iterations == 3   # prefill, two generation steps
        one_pass = ["save 0", "save 1", "save 2", "save 3", "end-of-pass", "wait_for_save"]
        assert worker.hooks[1:] == one_pass * 3


class _BadCallable(OracleWorker):
    def register_forward_pass_callable(self):
        return 42


class _RaisingCallable(OracleWorker):
    def register_forward_pass_callable(self):
        def boom():
            raise RuntimeError("event pool exhausted")
        return boom


def test_a_forward_pass_callable_that_is_not_callable_is_a_setup_error():
    with pytest.raises(InputError, match="returned 42, which is neither None nor callable"):
        make_engine(scripted(lambda r, n: (0, False), worker=_BadCallable))


def test_a_raising_forward_pass_callable_fails_the_pass_not_the_run():
    engine = make_engine(scripted(lambda r, n: (0, False), worker=_RaisingCallable))
    engine.add_request(Request(1, list(range(10)), 3))
    engine.run()
    state = engine.states[1]
    assert state.failure is FailureReason.CONNECTOR_FAILED_IN_PASS
    assert "forward pass callable (rank 0)" in state.error and "event pool exhausted" in state.error
    assert engine.manager.caches == [] and engine.manager.holds == []


def test_running_out_of_iterations_is_its_own_error():
    engine = make_engine()
    engine.add_request(Request(1, list(range(10)), 50))
    with pytest.raises(IterationLimitError, match="1 requests still unfinished after 5 iterations"):
        engine.run(max_iterations=5)
