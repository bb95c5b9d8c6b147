"""The runtime profiles (kvtool/engine/runtimes), unit by unit, through the engine.

Each test names the TensorRT-LLM fact it holds kvtool to:
- V1: /work/notes/trtllm-v1.md (resource_manager.py `KVCacheManager.prepare_resources`, which adds
  a sequence at its first chunk with the whole prompt's blocks; connectors/kv_cache_connector.py
  @035ab91c `build_scheduler_output`, `block_hashes` from #14806).
- main's V2: /work/notes/trtllm-main-v2.md section 1 (kv_cache_manager_v2.py `_run_kv_connector_hooks`,
  `_apply_connector_matched_prefix`, `_reserve_connector_prefix` at NVIDIA/TensorRT-LLM@10b8fbd9) and
  the unit tests of tests/unittest/_torch/executor/test_kv_connector_v2_prefix.py at the same
  commit (TestAskTiming, TestChunkedInsideTheChunk, TestChunkedBeyondTheChunk,
  test_a_failed_grow_commits_only_what_was_honoured, TestAsyncLoad).
Model: "tiny" (one layer group), tokens_per_block 32 unless a test says otherwise.
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.connector.api import KvCacheConnectorScheduler
from kvtool.connector.loader import ConnectorSpec
from kvtool.connector.request import Request
from kvtool.connector.runtime import ConnectorRuntime
from kvtool.engine.events import Ask, EventLog, LoadStarted, NotHonoured, PassDone, Paused, Reserve
from kvtool.engine.request_state import Phase
from kvtool.engine.runtimes import RUNTIMES, RuntimeName, profile_of
from kvtool.engine.runtimes.behaviours import BEHAVIOURS, ROWS, Behaviour, differences, value
from kvtool.engine.runtimes.block_hashes import block_hash, extend_block_hashes
from kvtool.group_pages import GroupPages
from kvtool.validate.harness import Context
from kvtool.validate.results import Verdict
from kvtool.validate.runner import run_all
from tests.helpers.connectors import NoOpWorker
from tests.helpers.engines import make_engine
from tests.helpers.mock_connector import mock_connector, outputs

TPB = 32
V1, V2, RELEASE = RuntimeName.TRTLLM_V1, RuntimeName.TRTLLM_V2, RuntimeName.TRTLLM_V2_RELEASE


def reports(mc, request_id=None):
    """Every RequestData reported, in order (of one request when given)."""
    return [r for out in outputs(mc) for r in out.new_requests + out.cached_requests
            if request_id is None or r.request_id == request_id]


def asks(mc):
    return [(c.args[0].request_id, c.args[1]) for c in mc.scheduler.get_num_new_matched_tokens.call_args_list]


def logged(engine) -> EventLog:
    log = EventLog()
    engine.events.subscribe(log)
    return log


# ---- trtllm-v1 -----------------------------------------------------------------------------------

@pytest.mark.parametrize("runtime", [V1, V2, RELEASE], ids=str)
def test_v1_allocates_the_whole_prompt_at_the_first_chunk_and_nothing_at_later_chunks(runtime):
    # prepare_resources adds a sequence only at its first context chunk, with every prompt block
    # (local reuse included); V2 profiles allocate the chunk's. Request 1 leaves its two full
    # blocks (pages 0, 1) in the radix tree; its partial third and decode pages go back.
    mc = mock_connector()
    engine = make_engine(mc.spec, tpb=TPB, num_slots=16, runtime=runtime, chunk_size=64, max_num_tokens=64)
    shared = list(range(1000, 1064))
    engine.add_request(Request(1, shared + list(range(1064, 1096)), 2))
    engine.run()
    engine.add_request(Request(2, shared + list(range(2000, 2100)), 2))   # 164 tokens: 6 blocks
    engine.step()
    state = engine.states[2]
    first_chunk = [0, 1, 4, 5, 6, 7] if runtime is V1 else [0, 1, 4, 5]   # chunk [64, 128) on V2
    request_1 = [0, 1, 2] if runtime is V1 else [0, 1]
    assert [c.args[1] for c in mc.scheduler.update_state_after_alloc.call_args_list] == [request_1, first_chunk]
    assert state.kv.page_indices_by_group().as_lists() == [first_chunk]
    assert [(r.computed_position, r.num_scheduled_tokens, r.new_block_ids) for r in reports(mc, 2)] \
        == [(64, 64, first_chunk)]
    engine.step()
    assert reports(mc, 2)[1].new_block_ids == ([] if runtime is V1 else [6, 7])
    assert state.kv.page_indices_by_group().as_lists() == [[0, 1, 4, 5, 6, 7]]


def test_v1_reports_the_whole_chain_of_full_block_hashes_on_every_report():
    # #14806: one 64-bit hash per full block, chained on its parent's, the salt in the first block
    # only, the whole chain so far on new and cached reports alike (not a delta).
    mc = mock_connector()
    engine = make_engine(mc.spec, tpb=TPB, runtime=V1)
    engine.add_request(Request(1, list(range(500, 570)), 30, cache_salt="tenant"))   # 70 tokens: 2 full blocks
    engine.run()
    tokens, seen, chains = engine.states[1].request.get_tokens(), 0, []
    for r in reports(mc):
        seen += len(r.new_tokens)
        chains.append(r.block_hashes)
        assert r.block_hashes == extend_block_hashes([], tokens[:seen], TPB, "tenant")
    assert seen == 70 + 29 and [len(c) for c in chains] == [2] * 26 + [3] * 4   # block 2 full at 96 tokens
    h0, h1, h2 = chains[-1]
    assert h0 == block_hash(0, tokens[:32], "tenant") != block_hash(0, tokens[:32], None)
    assert (h1, h2) == (block_hash(h0, tokens[32:64], None), block_hash(h1, tokens[64:96], None))
    assert block_hash(h0, tokens[32:64], "tenant") == h1          # a parent's hash carries the salt onward
    assert all(c == chains[-1][:len(c)] for c in chains)           # each report extends the one before


def test_v1_block_hashes_of_the_same_tokens_differ_in_every_block_under_another_salt():
    chains = {}
    for salt in ("a", "b", None):
        mc = mock_connector()
        engine = make_engine(mc.spec, tpb=TPB, runtime=V1)
        engine.add_request(Request(1, list(range(96)) + [7], 1, cache_salt=salt))
        engine.run()
        (r,) = reports(mc)
        chains[salt] = r.block_hashes
    assert len({len(c) for c in chains.values()}) == 1 and len(chains["a"]) == 3
    for i in range(3):
        assert len({chains[s][i] for s in chains}) == 3


def test_v1_hooks_are_flat_and_a_request_without_a_cache_gets_an_empty_list():
    mc = mock_connector()
    runtime = ConnectorRuntime(mc.spec.scheduler_class(None), [], flat_hooks=True)
    request = Request(1, [1, 2, 3], 1)
    assert runtime.after_alloc(request, GroupPages([[4, 5]])) and runtime.after_alloc(request, GroupPages([]))
    assert runtime.finish(request, GroupPages([[4, 5, 6]])) == (True, False)
    s = mc.scheduler
    assert [c.args[1] for c in s.update_state_after_alloc.call_args_list] == [[4, 5], []]
    assert [c.args[1] for c in s.request_finished.call_args_list] == [[4, 5, 6]]
    assert s.update_state_after_alloc_by_layer_group.call_count == s.request_finished_by_layer_group.call_count == 0


class GroupedOnlyScheduler(KvCacheConnectorScheduler):
    """Written for V2: the per-layer-group page hooks only (the flat ones are stand-ins that raise)."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc_by_layer_group(self, request, block_ids_by_layer_group):
        pass

    def build_connector_meta(self, scheduler_output):
        return None

    def request_finished_by_layer_group(self, request, cache_block_ids_by_layer_group):
        return False


class LayoutWorker(NoOpWorker):
    def register_kv_cache_layout(self, layout):
        self.layout = layout

    def register_kv_caches(self, kv_cache_tensor):
        self.tensor = kv_cache_tensor


GROUPED_ONLY = ConnectorSpec("grouped-only", GroupedOnlyScheduler, LayoutWorker, __name__)


@pytest.mark.parametrize("chosen", [False, True], ids=["by-default", "runtime-chosen"])
def test_a_grouped_only_scheduler_is_skipped_on_v1_unless_v1_is_asked_for(chosen):
    # TrtllmV1.cannot_host: V1 calls the flat forms (flat_hooks), which this class lacks.
    (result,) = run_all([Context(GROUPED_ONLY, "tiny", runtime=V1, runtime_chosen=chosen)], ["cold-warm"], 60,
                        isolated=False)
    assert (result.scenario, result.check, result.runtime) == ("setup", "registration", "trtllm-v1")
    assert result.verdict is (Verdict.FAIL if chosen else Verdict.SKIP)
    assert "implements only the per-layer-group form of update_state_after_alloc and request_finished" \
        in result.evidence[0]
    assert ("--runtime trtllm-v1 makes this a failure" in result.evidence[0]) is not chosen


def test_validate_with_runtime_trtllm_v1_fails_a_grouped_only_scheduler():
    result = CliRunner().invoke(app, ["validate", f"{__name__}:GroupedOnlyScheduler:LayoutWorker", "--runtime",
                                      "trtllm-v1", "--model", "tiny", "--scenario", "cold-warm"])
    assert result.exit_code == 1, result.output
    assert "implements only the per-layer-group form" in result.output


def test_profiles_say_who_cannot_host_whom():
    assert profile_of(V1).cannot_host(GroupedOnlyScheduler, LayoutWorker).startswith("GroupedOnlyScheduler implements")
    assert profile_of(V2).cannot_host(GroupedOnlyScheduler, LayoutWorker) is None
    assert profile_of(RELEASE).cannot_host(GroupedOnlyScheduler, LayoutWorker) is None


# ---- trtllm-v2 (main): the final-batch ask ---------------------------------------------------------

@pytest.mark.parametrize("runtime", [V2, RELEASE], ids=str)
def test_main_never_asks_about_a_request_the_scheduler_defers_and_release_does(runtime):
    # TestAskTiming: "the scheduling pass does not ask" (main); release asks in its Phase 1 and
    # may then defer (#18700). Request 2's first chunk cannot get pages while request 1 runs.
    mc = mock_connector()
    engine = make_engine(mc.spec, num_slots=16, runtime=runtime)
    engine.add_request(Request(1, list(range(100, 140)), 8))
    engine.add_request(Request(2, list(range(200, 240)), 8))
    engine.step()
    assert engine.states[2].num_deferrals == 1 and engine.states[2].phase is Phase.WAITING
    assert asks(mc) == ([(1, 0)] if runtime is V2 else [(1, 0), (2, 0)])
    assert engine.states[2].asked is (runtime is RELEASE)
    engine.run()
    assert sorted(asks(mc)) == [(1, 0), (2, 0)] and engine.stats.failures == []


def test_main_asks_once_per_allocation_however_many_chunks_it_takes():
    mc = mock_connector(matched=(32, False))
    engine = make_engine(mc.spec, tpb=TPB, runtime=V2, chunk_size=64, max_num_tokens=64)
    log = logged(engine)
    engine.add_request(Request(1, list(range(256)), 2))
    engine.run()
    assert asks(mc) == [(1, 0)] and [e.iteration for e in log.of(Ask)] == [1]
    assert [c.args[1] for c in mc.scheduler.update_state_after_alloc.call_args_list] == [[0, 1]]
    assert [(r.computed_position, r.num_scheduled_tokens) for r in reports(mc)][:4] \
        == [(0, 32), (64, 64), (128, 64), (192, 64)]


def test_main_asks_a_paused_request_again_and_reports_its_replay_new():
    # free_resources: "one ask per allocation, not one per request" (py_connector_allocation_reported
    # reset); test_a_destroyed_allocation_is_asked_again. MAX_UTILIZATION pauses the request started last.
    mc = mock_connector()
    engine = make_engine(mc.spec, num_slots=12, pause_to_grow=True, runtime=V2)
    log = logged(engine)
    for i in range(4):
        engine.add_request(Request(i, [i * 100 + t for t in range(10)], 12))
    engine.run()
    paused = [(e.iteration, e.request_id) for e in log.of(Paused)]
    assert paused == [(4, 3), (8, 2)]
    assert [(e.iteration, e.request_id) for e in log.of(Ask)] == [(1, 0), (1, 1), (1, 2), (1, 3), (13, 2), (13, 3)]
    for i in range(4):
        assert [rid for rid, _ in asks(mc)].count(i) == 1 + engine.states[i].num_pauses
    new = [r.request_id for out in outputs(mc) for r in out.new_requests]
    assert sorted(new) == [0, 1, 2, 2, 3, 3]
    assert [c.args[0].request_id for c in mc.scheduler.update_state_after_alloc.call_args_list] == [0, 1, 2, 3, 2, 3]
    assert engine.stats.failures == []


def test_main_serves_an_offer_inside_the_chunk_by_moving_the_chunk_start():
    # TestChunkedInsideTheChunk: offer 64 of a 256-token prompt, chunk 128: the chunk computes [64, 128).
    mc = mock_connector(matched=(64, False))
    engine = make_engine(mc.spec, tpb=TPB, runtime=V2, chunk_size=128, max_num_tokens=128)
    log = logged(engine)
    engine.add_request(Request(1, list(range(256)), 2))
    engine.run()
    assert [e.items for e in log.of(PassDone)][:2] == [((1, 64, 128),), ((1, 128, 256),)]
    assert [(r.computed_position, r.num_scheduled_tokens) for r in reports(mc)][:2] == [(0, 64), (128, 128)]
    assert log.of(Reserve) == [] and log.of(NotHonoured) == []   # the chunk's own pages hold it
    assert [c.args[1] for c in mc.scheduler.update_state_after_alloc.call_args_list] == [[0, 1, 2, 3]]
    assert engine.states[1].request.py_num_connector_matched_tokens == 64


def test_main_serves_an_offer_past_the_chunk_by_shifting_it_and_flooring_its_end_to_a_block():
    # TestChunkedBeyondTheChunk: offer 150 of 512, chunk 128: [150, 278) floored to [150, 256); the
    # allocation grows to 8 blocks before update_state_after_alloc reports it.
    mc = mock_connector(matched=(150, False))
    engine = make_engine(mc.spec, tpb=TPB, runtime=V2, chunk_size=128, max_num_tokens=128)
    log = logged(engine)
    engine.add_request(Request(1, list(range(512)), 2))
    engine.run()
    assert [e.items for e in log.of(PassDone)][:3] == [((1, 150, 256),), ((1, 256, 384),), ((1, 384, 512),)]
    assert [(r.computed_position, r.num_scheduled_tokens) for r in reports(mc)][:3] == [(0, 106), (256, 128),
                                                                                      (384, 128)]
    assert [(e.start, e.end, e.ok) for e in log.of(Reserve)] == [(0, 150, True)]
    assert [c.args[1] for c in mc.scheduler.update_state_after_alloc.call_args_list] == [list(range(8))]


def crowded(answer, chunk_size):
    """Main's V2, 10 pages of 32: request 1 (200 tokens) runs until it holds 7 pages, then request 2
    (256 tokens) arrives and is answered `answer`; its first chunk gets a page or two, no more."""
    mc = mock_connector()
    mc.scheduler.get_num_new_matched_tokens.side_effect = lambda r, n: answer if r.request_id == 2 else (0, False)
    engine = make_engine(mc.spec, tpb=TPB, num_slots=10, runtime=V2, chunk_size=chunk_size, max_num_tokens=256)
    log = logged(engine)
    engine.add_request(Request(1, list(range(1000, 1200)), 4))
    while engine.states[1].phase is not Phase.GENERATION:
        engine.step()
    assert engine.states[1].kv.page_indices_by_group().as_lists() == [list(range(7))]
    engine.add_request(Request(2, list(range(3000, 3256)), 1))
    return mc, engine, log


def test_main_commits_only_the_whole_blocks_the_chunk_holds_when_the_grow_fails():
    # test_a_failed_grow_commits_only_what_was_honoured: offer 128 past a 64-token chunk; growing
    # to 192 tokens fails; the fallback serves (64 - 1) // 32 * 32 = 32; no cancel_load for the rest.
    mc, engine, log = crowded((128, False), chunk_size=64)
    engine.step()
    b = engine.states[2]
    assert [(e.start, e.end, e.ok) for e in log.of(Reserve)] == [(0, 128, False)]
    assert (b.request.py_num_connector_matched_tokens, b.num_local_hit, b.position) == (32, 0, 64)
    assert [(e.start, e.end) for e in log.of(NotHonoured)] == [(32, 128)]
    assert [(e.num_tokens, e.is_async) for e in log.of(LoadStarted)] == [(32, False)]
    engine.run()
    mine = reports(mc, 2)
    assert [(r.computed_position, r.num_scheduled_tokens) for r in mine] == [(0, 32), (64, 64), (128, 64), (192, 64)]
    assert mine[0].new_block_ids == [7, 8] and mc.scheduler.cancel_load.call_count == 0
    assert engine.stats.failures == []


def test_main_parks_an_async_answer_even_when_it_honours_none_of_it():
    # TestAsyncLoad (0, 0, True): commit_new_matched_tokens passes load_kv_async through unchanged,
    # so the request is parked and awaited, then computed locally. Chunk 32: the fallback serves 0.
    mc, engine, log = crowded((128, True), chunk_size=32)
    engine.step()
    b = engine.states[2]
    assert b.phase is Phase.TRANSMISSION and b.request.py_num_connector_matched_tokens == 0
    assert mc.worker.get_finished.call_args_list[-1].args == ([], [2])   # awaited like any load
    assert [(e.start, e.end) for e in log.of(NotHonoured)] == [(0, 128)] and log.of(LoadStarted) == []
    assert reports(mc, 2) == []                                           # out of the batch
    answers = iter([([], [2])])                                            # the next poll reports it
    mc.worker.get_finished.side_effect = lambda saving, loading: next(answers, ([], []))
    engine.step()
    assert b.phase is Phase.CONTEXT
    engine.run()
    mine = reports(mc, 2)
    assert (mine[0].computed_position, mine[0].num_scheduled_tokens) == (0, 32)   # computed locally
    assert sum(r.num_scheduled_tokens for r in mine) == 256 and engine.stats.failures == []


# ---- the behaviour table ------------------------------------------------------------------------

def test_a_cell_that_reads_as_another_runtime_resolves_to_that_runtimes_text():
    registration = ROWS[Behaviour.REGISTRATION]
    assert registration.by_runtime[RELEASE] == "as `trtllm-v2`"
    assert value(registration, RELEASE) == value(registration, V2) == registration.by_runtime[V2]
    assert value(ROWS[Behaviour.ZERO_ASYNC], V1) == "refused: the request fails"


def test_differences_name_only_the_rows_where_two_runtimes_differ():
    rows = (Behaviour.REGISTRATION, Behaviour.ZERO_ASYNC, Behaviour.HOOK_FORMS, Behaviour.BLOCK_HASHES)
    assert differences(rows, RELEASE, V2) == [
        "an answer of `(0, True)`: trtllm-v2-release: a contract violation, taken as `(0, False)`; "
        "trtllm-v2: refused: the request fails"]
    assert [line.split(":")[0] for line in differences(rows, V1, V2)] == [
        "how a worker gets the cache", "page-list hooks", "`RequestData.block_hashes`"]
    assert differences(rows, V2, V2) == []


def test_every_row_has_a_cell_for_every_runtime_and_a_source():
    assert {row.behaviour for row in BEHAVIOURS} == set(Behaviour)
    for row in BEHAVIOURS:
        assert set(row.by_runtime) == set(RUNTIMES) and row.source
        for runtime in RUNTIMES:
            assert not value(row, runtime).startswith("as `")
