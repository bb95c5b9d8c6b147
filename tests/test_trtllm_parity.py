"""TensorRT-LLM's own connector-test expectations, ported as tests of kvtool's runtime profiles
(overlap scheduler off), so kvtool and TensorRT-LLM cannot drift apart.

"IT" is TensorRT-LLM's tests/integration/defs/llmapi/test_llm_api_connector.py at
NVIDIA/TensorRT-LLM@acec56b2 (M1-IT in /work/notes/trtllm-main-v2.md section 3; the reservation-era
additions at brb-nv/TensorRT-LLM@589ed684, M2-IT), run with `disable_overlap_scheduler=True`. Where
it is parametrized `use_kv_cache_manager_v2=[False, True]` (ids kv_cache_manager_v1 /
kv_cache_manager_v2), the port is parametrized over kvtool's runtime profiles: `trtllm-v1` takes
the kv_cache_manager_v1 expectations, `trtllm-v2` (main) and `trtllm-v2-release` the
kv_cache_manager_v2 ones, except where the release branch differs (its `cancel_load`, its
repair of `(0, True)`, no speculative-decoding refusal: trtllm-main-v2.md sections 1 and 4). The
overlap-scheduler parameter is not ported: kvtool has no overlap scheduler, so each count is
TensorRT-LLM's `overlap=False` one.

"UT" is its tests/unittest/_torch/test_connector.py; those ports describe the release V2 (the
default profile). The integration tests patch MagicMock scheduler and worker into the executor; here
a forwarding connector hands every hook call to MagicMocks (tests/helpers/mock_connector.py).
Model: kvtool's "tiny" preset (4 layers, 2 KV heads of 16, one layer group); tokens_per_block 32,
the tests' BLOCK_SIZE.

IT: test_simple <- test_connector_simple (and assert_kv_caches_registered); test_a_tensor_only_worker_...
<- the example worker's register_kv_caches note; test_async_onboard, test_async_save,
test_scheduler_output, test_scheduler_output_chunked_context, test_prefix_is_asked_once_...,
test_prefix_under_chunked_prefill, test_multi_request, test_priorities, test_priorities_default,
test_vswa_..., test_rejects_unsupported_config, test_max_utilization_..., test_spec_dec_... <-
test_connector_<same>; test_zero_async_... and test_an_offer_of_the_whole_prompt_... <- the V1 facts
of /work/notes/trtllm-v1.md section 1 (query_num_new_matched_tokens, setPrepopulatedPromptLen) and
_apply_connector_matched_prefix's clamp (trtllm-main-v2.md section 1).
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
from kvtool.connector.request import Request, RetentionConfig, TokenRangeRetention
from kvtool.connector.runtime import ConnectorRuntime, ViolationKind
from kvtool.engine.engine import Engine, EngineConfig
from kvtool.engine.events import Ask, EventLog, NotHonoured
from kvtool.engine.request_state import FailureReason, Phase
from kvtool.engine.runtimes import RuntimeName
from kvtool.engine.runtimes.block_hashes import extend_block_hashes
from kvtool.errors import RefusedSetupError
from kvtool.group_pages import GroupPages
from kvtool.manager import KvCacheManagerConfig
from kvtool.models import load_model
from tests.helpers.connectors import NoOpWorker
from tests.helpers.engines import make_engine, sched, scripted
from tests.helpers.mock_connector import first_args, mock_connector, order, outputs, request_ids, shape

TPB = 32          # BLOCK_SIZE of the integration tests
NUM_LAYERS = 4    # the "tiny" preset
POOL_ELEMENTS = TPB * 2 * 16   # a page's K (or V) of one layer: tokens_per_block * kv heads * head_dim
V1, V2, RELEASE = RuntimeName.TRTLLM_V1, RuntimeName.TRTLLM_V2, RuntimeName.TRTLLM_V2_RELEASE
RUNTIMES = pytest.mark.parametrize("runtime", list(RuntimeName), ids=str)
"""Where TensorRT-LLM's test is parametrized over both managers: V1, then main's and release's V2."""


def run(mc, prompts, max_tokens, runtime=RELEASE, tpb=TPB, num_slots=64, **kwargs):
    """An engine of `runtime` with the mock connector, request i+1 for prompts[i], run to the end."""
    engine = make_engine(mc.spec, tpb=tpb, num_slots=num_slots, runtime=runtime, **kwargs)
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(i + 1, prompt, max_tokens))
    engine.run()
    assert engine.stats.failures == []
    return engine


def alloc_calls(mc, runtime):
    """The page lists `update_state_after_alloc` got: V1 calls the flat form only; V2 the per-group
    form, which the forwarding mock folds onto the flat one (a single group), as TRT-LLM's fixture does."""
    s = mc.scheduler
    if runtime is V1:
        assert s.update_state_after_alloc_by_layer_group.call_count == 0
    else:
        assert [c.args[1] for c in s.update_state_after_alloc_by_layer_group.call_args_list] \
            == [[c.args[1]] for c in s.update_state_after_alloc.call_args_list]
    return [c.args[1] for c in s.update_state_after_alloc.call_args_list]


def finished_calls(mc, runtime):
    """The page lists `request_finished` got (flat on V1; per group, folded, on V2)."""
    s = mc.scheduler
    if runtime is V1:
        assert s.request_finished_by_layer_group.call_count == 0
    else:
        assert [c.args[1] for c in s.request_finished_by_layer_group.call_args_list] \
            == [[c.args[1]] for c in s.request_finished.call_args_list]
    return [c.args[1] for c in s.request_finished.call_args_list]


# ---- integration tests (IT) ------------------------------------------------------------------

@RUNTIMES
def test_simple(runtime):
    mc = mock_connector(matched=(0, False))
    run(mc, [[11, 12, 13, 14]], 8, runtime)                  # "Hello, world": less than one block
    s, w = mc.scheduler, mc.worker
    if runtime is V1:   # assert_kv_caches_registered: the one primary pool tensor, no layout
        assert (w.register_kv_caches.call_count, w.register_kv_cache_layout.call_count) == (1, 0)
        assert tuple(w.register_kv_caches.call_args.args[0].shape) == (64, NUM_LAYERS, 2, POOL_ELEMENTS)
    else:
        assert (w.register_kv_caches.call_count, w.register_kv_cache_layout.call_count) == (0, 1)
    assert alloc_calls(mc, runtime) == [[0]]                 # once, with the one block
    outs = outputs(mc)
    assert len(outs) == 8 and shape(outs[0]) == (1, 0)
    for out in outs[1:]:
        assert shape(out) == (0, 1) and len(out.cached_requests[0].new_tokens) == 1
    assert (s.build_connector_meta.call_count, w.start_load_kv.call_count,
            s.get_num_new_matched_tokens.call_count) == (8, 8, 1)
    layers = first_args(w.wait_for_layer_load)
    assert max(layers) + 1 == NUM_LAYERS
    assert layers == first_args(w.save_kv_layer) == [k % NUM_LAYERS for k in range(NUM_LAYERS * 8)]
    per_layer = [(c[0], c.args[0]) for c in mc.calls.mock_calls   # each layer: load-wait, then save
                 if c[0] in ("worker.wait_for_layer_load", "worker.save_kv_layer")]
    assert per_layer == [(f"worker.{hook}", k % NUM_LAYERS) for k in range(NUM_LAYERS * 8)
                         for hook in ("wait_for_layer_load", "save_kv_layer")]
    assert w.wait_for_save.call_count == 8
    assert finished_calls(mc, runtime) == [[0]]              # once, with the one block
    assert w.get_finished.call_count == 8


class _TensorOnlyWorker(NoOpWorker):
    """Written for the single-tensor API: overrides register_kv_caches only."""

    tensors: list = []

    def register_kv_caches(self, kv_cache_tensor):
        self.tensors.append(kv_cache_tensor)


@RUNTIMES
def test_a_tensor_only_worker_gets_the_same_pool_tensor_under_every_runtime(runtime):
    # V1 calls register_kv_caches itself; V2's register_kv_cache_layout default forwards the one pool.
    _TensorOnlyWorker.tensors = []
    mc = mock_connector()
    make_engine(ConnectorSpec("tensor-only", mc.spec.scheduler_class, _TensorOnlyWorker, __name__),
                tpb=TPB, num_slots=8, runtime=runtime)
    (tensor,) = _TensorOnlyWorker.tensors
    # [num_slots, num_layers, roles (K, V), tokens_per_block * kv heads * head_dim]
    assert tuple(tensor.shape) == (8, NUM_LAYERS, 2, POOL_ELEMENTS)   # TensorRT-LLM's primary pool


@RUNTIMES
def test_async_onboard(runtime):
    # The "Lorem ipsum ..." prompt: longer than the offer. tpb 16 keeps the 16-token offer block-aligned.
    mc = mock_connector(matched=(16, True), echo_finished=True)
    engine = run(mc, [list(range(1, 29))], 8, runtime, tpb=16)
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


@RUNTIMES
def test_async_save(runtime):
    mc = mock_connector(matched=(0, False), finish_async=True, echo_finished=True)
    engine = run(mc, [[11, 12, 13, 14]], 8, runtime)
    s, w = mc.scheduler, mc.worker
    assert finished_calls(mc, runtime) == [[0]]
    calls = w.get_finished.call_args_list
    assert len(calls) == 8 and all(c.args == ([], []) for c in calls[:-1])
    assert calls[-1].args == ([s.request_finished.call_args.args[0].request_id], [])
    at = order(mc, "scheduler.request_finished", "worker.get_finished")
    assert at["worker.get_finished"][-2] < at["scheduler.request_finished"][0] < at["worker.get_finished"][-1]
    assert engine.states[1].phase is Phase.DONE


@RUNTIMES
def test_scheduler_output(runtime):
    mc = mock_connector(matched=(0, False))
    engine = make_engine(mc.spec, tpb=TPB, num_slots=64, runtime=runtime)
    engine.add_request(Request(1, [0] * 48, 32))
    engine.run()
    assert [len(ids) for ids in alloc_calls(mc, runtime)] == [2]
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
        assert len(req.new_block_ids) == (1 if req.computed_position % TPB == 0 else 0)   # one per boundary
    tokens, seen = engine.states[1].request.get_tokens(), 0
    for (req,) in (out.new_requests + out.cached_requests for out in outs):
        seen += len(req.new_tokens)
        assert req.cache_salt is None and req.priorities is None
        if runtime is V1:   # flat ids only; the whole chain of full-block hashes so far (#14806)
            assert req.new_block_ids_by_layer_group == []
            assert req.block_hashes == extend_block_hashes([], tokens[:seen], TPB, None)
        else:
            assert req.block_hashes == []
            assert type(req.new_block_ids_by_layer_group[0]) is list
            assert req.new_block_ids_by_layer_group == [req.new_block_ids]
    assert seen == 48 + 31
    # TRT-LLM asserts ceil((48 + 32) / 32) = 3. kvtool holds KV for 48 + 31 tokens (the last
    # sampled token is never fed back), ceil(79 / 32) = 3 as well.
    assert [len(ids) for ids in finished_calls(mc, runtime)] == [3]
    # A second prompt with an offer of 8 (not block-aligned): reported at the local match.
    mc.scheduler.build_connector_meta.reset_mock()
    mc.scheduler.get_num_new_matched_tokens.return_value = (8, False)
    engine.add_request(Request(2, [1] * 48, 32))
    engine.run()
    first = outputs(mc)[0].new_requests[0]
    assert (first.request_id, first.computed_position, first.num_scheduled_tokens) == (2, 0, 40)
    assert engine.states[2].request.py_num_connector_matched_tokens == 8


@RUNTIMES
def test_scheduler_output_chunked_context(runtime):
    mc = mock_connector(matched=(0, False))
    run(mc, [[0] * 256], 32, runtime, chunk_size=128, max_num_tokens=128)
    outs = outputs(mc)
    # V1 allocates the whole prompt at the first chunk (first_chunk_blocks = total_blocks); V2 the chunk's.
    first_chunk_blocks = 8 if runtime is V1 else 4
    assert alloc_calls(mc, runtime) == [list(range(first_chunk_blocks))]
    assert len(outs) == 2 + 31 and shape(outs[0]) == (1, 0) and shape(outs[1]) == (0, 1)
    first, second = outs[0].new_requests[0], outs[1].cached_requests[0]
    assert (first.computed_position, len(first.new_tokens), first.new_block_ids, first.num_scheduled_tokens) \
        == (0, 256, list(range(first_chunk_blocks)), 128)
    assert (second.computed_position, len(second.new_tokens), second.new_block_ids, second.num_scheduled_tokens) \
        == (128, 0, list(range(first_chunk_blocks, 8)), 128)   # V1: [] (total - first chunk = 0)
    for out in outs[2:]:
        assert shape(out) == (0, 1)
        assert (len(out.cached_requests[0].new_tokens), out.cached_requests[0].num_scheduled_tokens) == (1, 1)
    # TRT-LLM: ceil((256 + 32) / 32) = 9; kvtool: ceil((256 + 31) / 32) = 9.
    assert finished_calls(mc, runtime) == [list(range(9))]


@RUNTIMES
def test_prefix_is_asked_once_and_shrinks_the_forward_pass(runtime):
    mc = mock_connector(matched=(64, False))
    engine = make_engine(mc.spec, tpb=TPB, num_slots=64, runtime=runtime)
    log = EventLog()
    engine.events.subscribe(log)
    engine.add_request(Request(1, [0] * 256, 4))
    engine.run()
    assert [(c.args[0].request_id, c.args[1]) for c in mc.scheduler.get_num_new_matched_tokens.call_args_list] \
        == [(1, 0)]
    assert [(e.iteration, e.num_computed_tokens, e.num_offered_tokens) for e in log.of(Ask)] == [(1, 0, 64)]
    at = order(mc, "scheduler.get_num_new_matched_tokens", "scheduler.build_connector_meta")
    assert at["scheduler.get_num_new_matched_tokens"][0] < at["scheduler.build_connector_meta"][0]
    first = outputs(mc)[0].new_requests[0]
    assert (first.computed_position, first.num_scheduled_tokens) == (0, 256 - 64)
    assert engine.states[1].request.py_num_connector_matched_tokens == 64


@RUNTIMES
@pytest.mark.parametrize("offer", [64, 192], ids=["offer_inside_chunk", "offer_past_chunk"])
def test_prefix_under_chunked_prefill(offer, runtime):
    mc = mock_connector(matched=(offer, False))
    run(mc, [[0] * 256], 4, runtime, chunk_size=128, max_num_tokens=128)
    assert [c.args[1] for c in mc.scheduler.get_num_new_matched_tokens.call_args_list] == [0]
    reports = [(r.computed_position, r.num_scheduled_tokens) for out in outputs(mc)
               for r in out.new_requests + out.cached_requests if r.num_scheduled_tokens > 1]
    assert reports[0][0] == 0 and all(n <= 128 for _, n in reports)
    assert sum(n for _, n in reports) == 256 - offer
    for i in range(1, len(reports)):
        assert reports[i][0] == offer + sum(n for _, n in reports[:i])
    # Exactly: an offer inside the chunk moves main's chunk start (the chunk keeps its end: [64, 128));
    # V1 and release start the chunk there and keep its size ([64, 192)). Past it: [192, 256) everywhere.
    inside = [(0, 64), (128, 128)] if runtime is V2 else [(0, 128), (192, 64)]
    assert reports == (inside if offer == 64 else [(0, 64)])
    assert [len(ids) for ids in finished_calls(mc, runtime)] == [9]   # TRT-LLM asserts >= 8


@RUNTIMES
def test_multi_request(runtime):
    # KvCacheConfig(max_tokens=144): 4 pages of 32. The third request needs all four, so the
    # pages of the first two (saved asynchronously) must be freed once their saves are reported.
    mc = mock_connector(matched=(0, False), finish_async=True, echo_finished=True)
    engine = make_engine(mc.spec, tpb=TPB, num_slots=4, runtime=runtime)
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


RETENTION = RetentionConfig((TokenRangeRetention(0, 32, 80), TokenRangeRetention(32, None, 10)), decode_priority=10)
"""test_connector_priorities' KvCacheRetentionConfig: block 0 at HIGH_PRIORITY 80, the rest (and
decode blocks) at LOW_PRIORITY 10."""


@RUNTIMES
def test_priorities(runtime):
    # TRT-LLM's V2 param is xfail(strict) (retention never reaches V2); kvtool's V2 profiles report
    # None, as test_connector_warns_that_retention_is_ignored_on_v2 asserts.
    mc = mock_connector(matched=(0, False))
    engine = make_engine(mc.spec, tpb=TPB, num_slots=64, runtime=runtime)
    engine.add_request(Request(1, [0] * 64, 4, retention=RETENTION))
    engine.run()
    outs = outputs(mc)
    (first,) = outs[0].new_requests
    assert len(first.new_block_ids) == 2
    if runtime is V1:
        assert first.priorities == [80, 10]
        # one per *new* block: the decode step that opens block 2 gets the decode priority
        assert [r.priorities for out in outs[1:] for r in out.cached_requests] == [[10], [], []]
    else:
        assert [r.priorities for out in outs for r in out.new_requests + out.cached_requests] == [None] * 4


@RUNTIMES
def test_priorities_default(runtime):
    mc = mock_connector(matched=(0, False))
    run(mc, [[0] * 48], 4, runtime)
    assert [r.priorities for out in outputs(mc) for r in out.new_requests + out.cached_requests] == [None] * 4


@RUNTIMES
def test_vswa_reports_page_indices_per_layer_group(runtime):
    # test_connector_vswa_reports_page_indices_per_layer_group: tiny-vswa has a sliding group
    # (window 8, group 0) and a full one (group 1); tpb 4.
    spec = scripted(lambda request, n: (0, False))
    if runtime is V1:
        with pytest.raises(RefusedSetupError, match="VSWA") as refused:
            make_engine(spec, model="tiny-vswa", runtime=runtime)
        assert not refused.value.blames_connector
        return
    engine = make_engine(spec, model="tiny-vswa", runtime=runtime)
    engine.add_request(Request(1, list(range(40)), 3))
    engine.run()
    s = sched(engine)
    assert s.calls == [("ask", 1, 0), ("alloc", 1, [list(range(10))] * 2),   # once, no flat form
                       ("finished", 1, [[-1] * 8 + [8, 9, 10], list(range(11))])]   # sliding: 3 live blocks
    reports = [r for out in s.outputs for r in out.new_requests + out.cached_requests]
    assert [r.new_block_ids for r in reports] == [[]] * 3
    assert [r.new_block_ids_by_layer_group for r in reports] == [[list(range(10))] * 2, [[10], [10]], [[], []]]
    assert engine.stats.failures == [] and engine.integrity_errors == 0


@RUNTIMES
def test_rejects_unsupported_config_host_offloading(runtime):
    # test_connector_rejects_unsupported_config[host_offloading]; beam search and attention DP
    # are not reachable in kvtool (no beams, no ADP).
    config = EngineConfig(KvCacheManagerConfig(load_model("tiny"), TPB, num_slots=8, device="cpu",
                                               host_cache_bytes=1 << 30), runtime=runtime)
    match = "host offloading" if runtime is V1 else "cache tiers below GPU"
    with pytest.raises(RefusedSetupError, match=match):
        Engine(config, mock_connector().spec)


@RUNTIMES
def test_max_utilization_is_rejected_on_v1_only(runtime):
    mc = mock_connector(matched=(0, False))
    if runtime is V1:
        with pytest.raises(RefusedSetupError, match="GUARANTEED_NO_EVICT"):
            make_engine(mc.spec, tpb=TPB, pause_to_grow=True, runtime=runtime)
        return
    run(mc, [[0] * 48], 2, runtime, pause_to_grow=True)   # constructs, and runs


@RUNTIMES
def test_spec_dec_is_rejected_on_v2_only(runtime):
    # "V2" is main's (M2-IT); the release profile refuses only tiers below GPU, so drafts run there as on V1.
    mc = mock_connector(matched=(0, False))
    if runtime is V2:
        with pytest.raises(RefusedSetupError, match="speculative decoding"):
            make_engine(mc.spec, tpb=TPB, draft_tokens=3, runtime=runtime)
        return
    engine = run(mc, [[0] * 48], 6, runtime, draft_tokens=3)
    assert engine.states[1].phase is Phase.DONE


@RUNTIMES
def test_zero_async_fails_the_request_on_v1_and_main_but_is_repaired_on_release(runtime):
    # query_num_new_matched_tokens: RuntimeError("load_kv_async must be False when num_tokens is 0!")
    # on V1 and main; the release profile records the violation and takes (0, False).
    mc = mock_connector(matched=(0, True))
    engine = make_engine(mc.spec, tpb=TPB, runtime=runtime)
    engine.add_request(Request(1, list(range(64)), 2))
    engine.run()
    state = engine.states[1]
    assert [v.check for v in engine.connector.violations] == [ViolationKind.ZERO_ASYNC]
    assert mc.scheduler.get_num_new_matched_tokens.call_count == 1
    if runtime is RELEASE:
        assert state.phase is Phase.DONE and engine.stats.failures == []
        assert mc.worker.get_finished.call_args_list[0].args == ([], [])   # nothing parked: (0, False)
    else:
        assert (state.phase, state.failure) == (Phase.FAILED, FailureReason.ASK_REFUSED)
        assert "(0, True)" in state.error
        assert mc.scheduler.build_connector_meta.call_count == 0   # it never ran


@RUNTIMES
def test_an_offer_of_the_whole_prompt_is_refused_on_v1_and_clamped_on_v2(runtime):
    mc = mock_connector(matched=(64, False))
    engine = make_engine(mc.spec, tpb=TPB, runtime=runtime)
    log = EventLog()
    engine.events.subscribe(log)
    engine.add_request(Request(1, list(range(64)), 2))
    engine.run()
    state, s = engine.states[1], mc.scheduler
    if runtime is V1:   # setPrepopulatedPromptLen: "prepopulatedPromptLen (64) >= promptLen (64)"
        assert (state.phase, state.failure) == (Phase.FAILED, FailureReason.ASK_REFUSED)
        assert "prepopulatedPromptLen >= promptLen" in state.error
        assert (s.build_connector_meta.call_count, state.request.py_num_connector_matched_tokens) == (0, 0)
        return
    assert state.phase is Phase.DONE and state.request.py_num_connector_matched_tokens == 63
    first = outputs(mc)[0].new_requests[0]
    assert (first.computed_position, first.num_scheduled_tokens) == (0, 1)
    if runtime is RELEASE:
        assert [c.args[1:] for c in s.cancel_load.call_args_list] == [(63, 64)] and log.of(NotHonoured) == []
    else:   # main has no cancel_load: the last position is not handed back
        assert s.cancel_load.call_count == 0
        assert [(e.start, e.end) for e in log.of(NotHonoured)] == [(63, 64)]


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
