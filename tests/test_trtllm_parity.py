"""TensorRT-LLM's own connector-test expectations, ported as tests of kvtool's runtime (overlap
scheduler off, the V2 KV cache manager's behaviour), so kvtool and TensorRT-LLM cannot drift apart.

"IT" is TensorRT-LLM's tests/integration/defs/llmapi/test_llm_api_connector.py (run with
`disable_overlap_scheduler=True`, `use_kv_cache_manager_v2=True`), "UT" its
tests/unittest/_torch/test_connector.py. The integration tests patch MagicMock scheduler and worker
into the executor; here a forwarding connector hands every hook call to MagicMocks
(tests/helpers/mock_connector.py). Model: kvtool's "tiny" preset (4 layers, one layer group);
tokens_per_block 32, the tests' BLOCK_SIZE.

IT (each [overlap False, v2]): test_simple <- test_connector_simple; test_a_tensor_only_worker_...
<- assert_kv_caches_registered and the example worker's register_kv_caches note; test_async_onboard,
test_async_save, test_scheduler_output, test_scheduler_output_chunked_context <- test_connector_<same>;
test_prefix_is_asked_once_..., test_prefix_under_chunked_prefill, test_multi_request <- test_connector_<same>.
UT: test_a_per_layer_group_connector_needs_no_flat_stubs, test_a_connector_implementing_neither_form_...,
test_an_empty_group_list_reaches_the_flat_callbacks <- the tests of the same names;
test_matched_tokens_are_the_committed_amount_* <- test_connector_manager_commits_only_what_is_honoured;
test_a_replayed_request_is_new_and_whole_... <- test_scheduler_output_resets_a_destroyed_allocation and
test_scheduler_output_keeps_deltas_while_the_allocation_lives; test_cancel_load_and_request_reset_...
<- the documented no-op defaults (TRT-LLM's connector docs; mooncake-store overrides both).
"""

from __future__ import annotations

import pytest

from kvtool.connector.api import KvCacheConnectorScheduler
from kvtool.connector.loader import ConnectorSpec
from kvtool.connector.request import Request
from kvtool.connector.runtime import ConnectorRuntime
from kvtool.engine.request_state import Phase
from kvtool.group_pages import GroupPages
from tests.helpers.connectors import NoOpWorker
from tests.helpers.engines import make_engine
from tests.helpers.mock_connector import first_args, mock_connector, order, outputs, request_ids, shape

TPB = 32          # BLOCK_SIZE of the integration tests
NUM_LAYERS = 4    # the "tiny" preset


def run(mc, prompts, max_tokens, tpb=TPB, num_slots=64, **kwargs):
    """An engine with the mock connector, request i+1 for prompts[i], run to the end."""
    engine = make_engine(mc.spec, tpb=tpb, num_slots=num_slots, **kwargs)
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(i + 1, prompt, max_tokens))
    engine.run()
    assert engine.stats.failures == []
    return engine


# ---- integration tests (IT) ------------------------------------------------------------------

def test_simple():
    mc = mock_connector(matched=(0, False))
    run(mc, [[11, 12, 13, 14]], 8)                  # "Hello, world": less than one block
    s, w = mc.scheduler, mc.worker
    assert (w.register_kv_cache_layout.call_count, w.register_kv_caches.call_count) == (1, 0)
    for hook in (s.update_state_after_alloc_by_layer_group, s.update_state_after_alloc):   # grouped, folded
        assert hook.call_count == 1 and len(hook.call_args.args[1]) == 1
    outs = outputs(mc)
    assert len(outs) == 8 and shape(outs[0]) == (1, 0)
    for out in outs[1:]:
        assert shape(out) == (0, 1) and len(out.cached_requests[0].new_tokens) == 1
    assert (w.start_load_kv.call_count, s.get_num_new_matched_tokens.call_count) == (8, 1)
    layers = first_args(w.wait_for_layer_load)
    assert max(layers) + 1 == NUM_LAYERS
    assert layers == first_args(w.save_kv_layer) == [k % NUM_LAYERS for k in range(NUM_LAYERS * 8)]
    per_layer = [(c[0], c.args[0]) for c in mc.calls.mock_calls   # each layer: load-wait, then save
                 if c[0] in ("worker.wait_for_layer_load", "worker.save_kv_layer")]
    assert per_layer == [(f"worker.{hook}", k % NUM_LAYERS) for k in range(NUM_LAYERS * 8)
                         for hook in ("wait_for_layer_load", "save_kv_layer")]
    assert w.wait_for_save.call_count == 8
    assert s.request_finished.call_count == 1 and len(s.request_finished.call_args.args[1]) == 1
    assert w.get_finished.call_count == 8


class _TensorOnlyWorker(NoOpWorker):
    """Written for the single-tensor API: overrides register_kv_caches only."""

    tensors: list = []

    def register_kv_caches(self, kv_cache_tensor):
        self.tensors.append(kv_cache_tensor)


def test_a_tensor_only_worker_gets_the_pool_through_the_layout_default():
    _TensorOnlyWorker.tensors = []
    mc = mock_connector()
    make_engine(ConnectorSpec("tensor-only", mc.spec.scheduler_class, _TensorOnlyWorker, __name__),
                tpb=TPB, num_slots=8)
    (tensor,) = _TensorOnlyWorker.tensors
    # [num_slots, num_layers, roles (K, V), tokens_per_block, kv heads, head_dim]
    assert tuple(tensor.shape) == (8, NUM_LAYERS, 2, TPB * 2 * 16)   # TensorRT-LLM's primary pool


def test_async_onboard():
    # The "Lorem ipsum ..." prompt: longer than the offer. tpb 16 keeps the 16-token offer block-aligned.
    mc = mock_connector(matched=(16, True), echo_finished=True)
    engine = run(mc, [list(range(1, 29))], 8, tpb=16)
    w = mc.worker
    assert w.get_finished.call_count == 8 + 1      # the loading iteration's poll, then one per token
    assert w.get_finished.call_args_list[0].args == ([], [1])   # started-loading ids: length 1
    # The loading iteration builds metadata and starts the load, but runs no forward pass.
    assert mc.scheduler.build_connector_meta.call_count == w.start_load_kv.call_count == 9
    assert w.wait_for_save.call_count == 8
    assert len(first_args(w.wait_for_layer_load)) == len(first_args(w.save_kv_layer)) == NUM_LAYERS * 8
    outs = outputs(mc)
    assert (shape(outs[0]), shape(outs[1])) == ((0, 0), (1, 0))   # skipped while loading (loading_ids)
    # TRT-LLM clears external_loads in the loading iteration's build, so the report after the load
    # is at the position past it (API facts 1.6).
    assert (outs[1].new_requests[0].computed_position, outs[1].new_requests[0].num_scheduled_tokens) == (16, 28 - 16)
    assert engine.states[1].request.py_num_connector_matched_tokens == 16


def test_async_save():
    mc = mock_connector(matched=(0, False), finish_async=True, echo_finished=True)
    engine = run(mc, [[11, 12, 13, 14]], 8)
    s, w = mc.scheduler, mc.worker
    assert s.request_finished.call_count == 1 and len(s.request_finished.call_args.args[1]) == 1
    calls = w.get_finished.call_args_list
    assert len(calls) == 8 and all(c.args == ([], []) for c in calls[:-1])
    assert calls[-1].args == ([s.request_finished.call_args.args[0].request_id], [])
    at = order(mc, "scheduler.request_finished", "worker.get_finished")
    assert at["worker.get_finished"][-2] < at["scheduler.request_finished"][0] < at["worker.get_finished"][-1]
    assert engine.states[1].phase is Phase.DONE


def test_scheduler_output():
    mc = mock_connector(matched=(0, False))
    engine = make_engine(mc.spec, tpb=TPB, num_slots=64)
    engine.add_request(Request(1, [0] * 48, 32))
    engine.run()
    s = mc.scheduler
    assert s.update_state_after_alloc.call_count == 1 and len(s.update_state_after_alloc.call_args.args[1]) == 2
    outs = outputs(mc)
    assert len(outs) == 32
    assert shape(outs[0]) == (1, 0)
    req = outs[0].new_requests[0]
    assert (len(req.new_tokens), len(req.new_block_ids), req.computed_position, req.num_scheduled_tokens) \
        == (48, 2, 0, 48)
    for out in outs[1:]:
        assert shape(out) == (0, 1)
        req = out.cached_requests[0]
        assert (len(req.new_tokens), req.num_scheduled_tokens) == (1, 1)
        assert len(req.new_block_ids) == (1 if req.computed_position % TPB == 0 else 0)
    for (req,) in (out.new_requests + out.cached_requests for out in outs):
        assert req.block_hashes == [] and req.priorities is None and req.cache_salt is None
        assert type(req.new_block_ids_by_layer_group) is list and type(req.new_block_ids_by_layer_group[0]) is list
        assert req.new_block_ids_by_layer_group == [req.new_block_ids]
    # TRT-LLM asserts ceil((48 + 32) / 32) = 3. kvtool holds KV for 48 + 31 tokens (the last
    # sampled token is never fed back), ceil(79 / 32) = 3 as well.
    assert len(s.request_finished.call_args.args[1]) == 3
    # A second prompt with an offer of 8 (not block-aligned): reported at the local match.
    s.build_connector_meta.reset_mock()
    s.get_num_new_matched_tokens.return_value = (8, False)
    engine.add_request(Request(2, [1] * 48, 32))
    engine.run()
    first = outputs(mc)[0].new_requests[0]
    assert (first.request_id, first.computed_position, first.num_scheduled_tokens) == (2, 0, 40)
    assert engine.states[2].request.py_num_connector_matched_tokens == 8


def test_scheduler_output_chunked_context():
    mc = mock_connector(matched=(0, False))
    run(mc, [[0] * 256], 32, chunk_size=128, max_num_tokens=128)
    s, outs = mc.scheduler, outputs(mc)
    assert s.update_state_after_alloc.call_count == 1
    assert len(s.update_state_after_alloc.call_args.args[1]) == 4      # V2: the first chunk's pages only
    assert len(outs) == 2 + 31 and shape(outs[0]) == (1, 0) and shape(outs[1]) == (0, 1)
    first, second = outs[0].new_requests[0], outs[1].cached_requests[0]
    assert (first.computed_position, len(first.new_tokens), len(first.new_block_ids),
            first.num_scheduled_tokens) == (0, 256, 4, 128)
    assert (second.computed_position, len(second.new_tokens), len(second.new_block_ids),
            second.num_scheduled_tokens) == (128, 0, 8 - 4, 128)
    for out in outs[2:]:
        assert shape(out) == (0, 1)
        assert (len(out.cached_requests[0].new_tokens), out.cached_requests[0].num_scheduled_tokens) == (1, 1)
    # TRT-LLM: ceil((256 + 32) / 32) = 9; kvtool: ceil((256 + 31) / 32) = 9.
    assert len(s.request_finished.call_args.args[1]) == 9


def test_prefix_is_asked_once_and_shrinks_the_forward_pass():
    mc = mock_connector(matched=(64, False))
    engine = run(mc, [[0] * 256], 4)
    assert [(c.args[0].request_id, c.args[1]) for c in mc.scheduler.get_num_new_matched_tokens.call_args_list] \
        == [(1, 0)]
    at = order(mc, "scheduler.get_num_new_matched_tokens", "scheduler.build_connector_meta")
    assert at["scheduler.get_num_new_matched_tokens"][0] < at["scheduler.build_connector_meta"][0]
    first = outputs(mc)[0].new_requests[0]
    assert (first.computed_position, first.num_scheduled_tokens) == (0, 256 - 64)
    assert engine.states[1].request.py_num_connector_matched_tokens == 64


@pytest.mark.parametrize("offer", [64, 192])
def test_prefix_under_chunked_prefill(offer):
    mc = mock_connector(matched=(offer, False))
    run(mc, [[0] * 256], 4, chunk_size=128, max_num_tokens=128)
    assert [c.args[1] for c in mc.scheduler.get_num_new_matched_tokens.call_args_list] == [0]
    reports = [(r.computed_position, r.num_scheduled_tokens) for out in outputs(mc)
               for r in out.new_requests + out.cached_requests if r.num_scheduled_tokens > 1]
    assert reports[0][0] == 0 and all(n <= 128 for _, n in reports)
    assert sum(n for _, n in reports) == 256 - offer
    for i in range(1, len(reports)):
        assert reports[i][0] == offer + sum(n for _, n in reports[:i])
    assert len(mc.scheduler.request_finished.call_args.args[1]) == 9   # TRT-LLM asserts >= 8


def test_multi_request():
    # KvCacheConfig(max_tokens=144): 4 pages of 32. The third request needs all four, so the
    # pages of the first two (saved asynchronously) must be freed once their saves are reported.
    mc = mock_connector(matched=(0, False), finish_async=True, echo_finished=True)
    engine = make_engine(mc.spec, tpb=TPB, num_slots=4)
    engine.add_request(Request(1, [0] * 48, 4))
    engine.add_request(Request(2, [1] * 48, 3))
    engine.run()
    assert [r.request_id for r in outputs(mc)[0].new_requests] == [1, 2]   # both in one batch
    engine.add_request(Request(3, [2] * 110, 4))
    engine.run()
    assert request_ids(mc.scheduler.get_num_new_matched_tokens) == [1, 2, 3]        # each asked once
    assert sorted(r.request_id for out in outputs(mc) for r in out.new_requests) == [1, 2, 3]
    assert request_ids(mc.scheduler.request_finished) == [1, 2, 3]
    assert sorted(rid for saving in first_args(mc.worker.get_finished) for rid in saving) == [1, 2, 3]
    assert [engine.states[i].phase for i in (1, 2, 3)] == [Phase.DONE] * 3 and engine.stats.failures == []


# ---- unit semantics (UT) ---------------------------------------------------------------------

class _NeitherScheduler(KvCacheConnectorScheduler):
    """Implements neither form of update_state_after_alloc / request_finished."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def build_connector_meta(self, scheduler_output):
        return None


class _GroupedOnlyScheduler(_NeitherScheduler):
    def update_state_after_alloc_by_layer_group(self, request, block_ids_by_layer_group):
        pass

    def request_finished_by_layer_group(self, request, cache_block_ids_by_layer_group):
        return False


class _FlatOnlyScheduler(_NeitherScheduler):
    def update_state_after_alloc(self, request, block_ids):
        pass

    def request_finished(self, request, cache_block_ids):
        return False


class _LayoutOnlyWorker(NoOpWorker):
    """The per-pass hooks and register_kv_cache_layout; no register_kv_caches."""

    def register_kv_cache_layout(self, layout):
        self.layout = layout


def test_a_per_layer_group_connector_needs_no_flat_stubs():
    scheduler, worker = _GroupedOnlyScheduler(llm_args=None), _LayoutOnlyWorker(llm_args=None)
    with pytest.raises(NotImplementedError, match="register_kv_cache_layout"):
        worker.register_kv_caches(None)
    with pytest.raises(NotImplementedError, match="request_finished_by_layer_group"):
        scheduler.request_finished(None, [])
    with pytest.raises(NotImplementedError, match="update_state_after_alloc_by_layer_group"):
        scheduler.update_state_after_alloc(None, [])
    # And the engine runs it (the runtime only ever calls the grouped forms).
    engine = make_engine(ConnectorSpec("grouped", _GroupedOnlyScheduler, _LayoutOnlyWorker, __name__), tpb=TPB)
    engine.add_request(Request(1, list(range(40)), 2))
    engine.run()
    assert engine.states[1].phase is Phase.DONE and engine.connector.failures == []


def test_a_connector_implementing_neither_form_still_fails_at_construction():
    with pytest.raises(TypeError, match="request_finished"):
        _NeitherScheduler(llm_args=None)


def test_an_empty_group_list_reaches_the_flat_callbacks():
    mc = mock_connector(finish_async=False)
    runtime = ConnectorRuntime(mc.spec.scheduler_class(None), [])
    request = Request(7, [1, 2, 3], 1)
    assert runtime.after_alloc(request, GroupPages([])) is True
    assert runtime.finish(request, GroupPages([])) == (True, False)
    s = mc.scheduler   # the flat forms, each once, with the empty list
    assert [c.args for c in s.update_state_after_alloc.call_args_list] == [(request, [])]
    assert [c.args for c in s.request_finished.call_args_list] == [(request, [])]
    assert s.update_state_after_alloc_by_layer_group.call_count == s.request_finished_by_layer_group.call_count == 0
    assert runtime.failures == [] and runtime.violations == []


def test_matched_tokens_are_the_committed_amount_after_a_clamp():
    mc = mock_connector(matched=(64, False))      # the whole prompt: its last position is cut off
    engine = run(mc, [list(range(64))], 2)
    assert engine.states[1].request.py_num_connector_matched_tokens == 63
    assert [c.args[1:] for c in mc.scheduler.cancel_load.call_args_list] == [(63, 64)]
    first = outputs(mc)[0].new_requests[0]
    assert (first.computed_position, first.num_scheduled_tokens) == (0, 1)


def test_matched_tokens_are_the_committed_amount_when_the_local_match_overtakes():
    # Request 2 is offered 96 at local match 0, reserves, is deferred (no pages); request 1 then
    # commits their shared 64-token prefix, so only 96 - 64 = 32 tokens are honoured.
    mc = mock_connector()
    mc.scheduler.get_num_new_matched_tokens.side_effect = \
        lambda request, n: (96, False) if request.request_id == 2 else (0, False)
    shared = list(range(5, 69))
    engine = run(mc, [shared + list(range(200, 264)), shared + list(range(300, 364))], 1, num_slots=7)
    assert engine.states[2].num_deferrals == 1 and request_ids(mc.scheduler.get_num_new_matched_tokens) == [1, 2]
    assert [c.args[1:] for c in mc.scheduler.cancel_load.call_args_list] == [(0, 64)]
    assert engine.states[2].request.py_num_connector_matched_tokens == 32
    (report,) = [r for out in outputs(mc) for r in out.new_requests if r.request_id == 2]
    assert (report.computed_position, report.num_scheduled_tokens) == (64, 128 - 96)


@pytest.mark.parametrize("replayed", [False, True])
def test_a_replayed_request_is_new_and_whole_while_deltas_stay_deltas_otherwise(replayed):
    # Replayed in prefill (TRT-LLM's UT uses a context request: generation ones are always cached).
    mc = mock_connector()
    engine = make_engine(mc.spec, tpb=TPB, num_slots=64, chunk_size=128)
    engine.add_request(Request(1, [0] * 256, 4))
    engine.step()
    assert shape(outputs(mc)[0]) == (1, 0) and outputs(mc)[0].new_requests[0].new_block_ids == [0, 1, 2, 3]
    if replayed:
        engine.states[1].forget_reported()      # TRT-LLM's reset_request: the allocation was destroyed
    engine.step()
    second = outputs(mc)[1]
    assert shape(second) == ((1, 0) if replayed else (0, 1))
    req = (second.new_requests + second.cached_requests)[0]
    assert req.new_block_ids == ([0, 1, 2, 3, 4, 5, 6, 7] if replayed else [4, 5, 6, 7])
    assert req.new_block_ids_by_layer_group == [req.new_block_ids]
    assert len(req.new_tokens) == (256 if replayed else 0)
    engine.step()                               # deltas again after the replay's report
    assert shape(outputs(mc)[2]) == (0, 1) and outputs(mc)[2].cached_requests[0].new_block_ids == [8]


def test_cancel_load_and_request_reset_have_no_op_defaults():
    assert {"cancel_load", "request_reset"}.isdisjoint(KvCacheConnectorScheduler.__abstractmethods__)
    scheduler = _FlatOnlyScheduler(llm_args=None)
    request = Request(3, list(range(8)), 1)
    assert scheduler.cancel_load(request, 0, 4) is None
    assert scheduler.request_reset(request) is None
