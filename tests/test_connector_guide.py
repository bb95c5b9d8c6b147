"""docs/connector-guide.md's rules, one test each: a test named `test_<RULE>_...` asserts rule RULE
(C call order, D RequestData, L loads, S saves, T the store) against kvtool's runtime, with a
scripted scheduler and a worker that writes the right bytes into loaded pages, so the fake engine
verifies every byte a pass reads. `test_every_rule_has_a_test_and_every_test_a_rule` ties the guide
and this file together."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from kvtool.connector.request import Request
from kvtool.connectors.registry import load_connector
from kvtool.engine.request_state import Phase
from kvtool.types import BAD_PAGE_INDEX
from kvtool.validate.harness import Context
from kvtool.validate.runner import run_all, run_isolated
from kvtool.validate.user_store import engine_store_folders
from tests.helpers import module_store_connector
from tests.helpers.connectors import OracleWorker
from tests.helpers.engines import make_engine, scripted

ROOT = Path(__file__).parents[1]
GUIDE = ROOT / "docs" / "connector-guide.md"
EXAMPLE = ROOT / "examples" / "dict_connector.py"
T = 4                                  # tokens per block
LAYERS = 4                             # the "tiny" preset
LOG: list[tuple] = []
"""Every hook call of both sides, in order: (hook, first argument)."""


class LoggingWorker(OracleWorker):
    def bind_connector_meta(self, metadata):
        LOG.append(("bind", None))
        super().bind_connector_meta(metadata)

    def start_load_kv(self, stream):
        LOG.append(("start_load_kv", None))
        super().start_load_kv(stream)

    def wait_for_layer_load(self, layer_idx, stream):
        LOG.append(("wait_for_layer_load", layer_idx))

    def save_kv_layer(self, layer_idx, stream):
        LOG.append(("save_kv_layer", layer_idx))

    def wait_for_save(self, stream):
        LOG.append(("wait_for_save", None))

    def get_finished(self, finished_gen_req_ids, started_loading_req_ids):
        LOG.append(("get_finished", (list(finished_gen_req_ids), list(started_loading_req_ids))))
        return super().get_finished(finished_gen_req_ids, started_loading_req_ids)


SCHEDULER_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc_by_layer_group", "build_connector_meta",
                   "request_finished_by_layer_group", "cancel_load")


def engine_with(answer, finish_async=False, model="tiny", **kwargs):
    """An engine whose scheduler answers `answer(request, num_computed)`, calls logged in LOG."""
    LOG.clear()
    spec = scripted(answer, finish_async, worker=LoggingWorker)
    sched = spec.scheduler_class
    for hook in SCHEDULER_HOOKS:
        setattr(sched, hook, _logged(hook, getattr(sched, hook)))
    engine = make_engine(spec, model=model, tpb=T, **kwargs)
    engine.events.subscribe(lambda e: None)
    return engine


def _logged(name, method):
    def hook(self, *args):
        LOG.append((name, getattr(args[0], "request_id", args[0])))
        return method(self, *args)
    return hook


def run(engine, *requests):
    for r in requests:
        engine.add_request(r)
    engine.run()
    assert engine.stats.failures == [] and engine.integrity_errors == 0
    return engine


def reports(engine):
    """(iteration's output index, 'new'|'cached', RequestData) of every report, in order."""
    return [(i, kind, data) for i, out in enumerate(engine.connector.scheduler.outputs)
            for kind, group in (("new", out.new_requests), ("cached", out.cached_requests)) for data in group]


def at(name, arg=None):
    return [i for i, (hook, a) in enumerate(LOG) if hook == name and (arg is None or a == arg)]


PROMPT = tuple(range(1, 10 * T + 3))   # 10 blocks and 2 tokens


# ---- call order ---------------------------------------------------------------------------------

def test_C0_construction_registration_then_wait_for_initialization_once_then_the_first_ask():
    events: list[str] = []

    class Worker(LoggingWorker):
        def __init__(self, llm_args):
            events.append("worker")
            super().__init__(llm_args)

        def register_kv_cache_layout(self, layout):
            events.append("register")
            super().register_kv_cache_layout(layout)

    spec = scripted(lambda r, n: (0, False), worker=Worker)

    class Scheduler(spec.scheduler_class):
        def __init__(self, llm_args):
            events.append("scheduler")
            super().__init__(llm_args)

        def wait_for_initialization(self):
            events.append("wait_for_initialization")

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            events.append("ask")
            return super().get_num_new_matched_tokens(request, num_computed_tokens)

    engine = make_engine(replace(spec, scheduler_class=Scheduler), tpb=T)
    assert events == ["scheduler", "worker", "register", "wait_for_initialization"]
    run(engine, Request(1, PROMPT, 2))
    assert events == ["scheduler", "worker", "register", "wait_for_initialization", "ask"]


def test_C1_asked_once_with_the_local_match_before_any_other_hook():
    engine = engine_with(lambda r, n: (0, False), local_reuse=True)
    run(engine, Request(1, PROMPT, 2))
    run(engine, Request(2, PROMPT[:6 * T] + (999,) * 5, 2))   # shares 6 blocks with request 1
    asks = engine.connector.scheduler.asks()
    assert asks == [("ask", 1, 0), ("ask", 2, 6 * T)]
    for rid in (1, 2):
        first = min(i for i, (hook, a) in enumerate(LOG) if a == rid and hook in SCHEDULER_HOOKS)
        assert LOG[first] == ("get_num_new_matched_tokens", rid)


def test_C1_a_deferred_request_is_not_asked_again():
    engine = engine_with(lambda r, n: (0, False), num_slots=12)
    run(engine, Request(1, PROMPT, 2), Request(2, tuple(range(500, 500 + 8 * T)), 2))
    assert sorted(c[1] for c in engine.connector.scheduler.asks()) == [1, 2]


def test_C2_pages_of_the_first_chunk_after_the_ask_before_the_first_report():
    engine = engine_with(lambda r, n: (0, False), chunk_size=3 * T)
    run(engine, Request(1, PROMPT, 2))
    (alloc,) = at("update_state_after_alloc_by_layer_group")
    assert at("get_num_new_matched_tokens")[0] < alloc < at("build_connector_meta")[0]
    (call,) = [c for c in engine.connector.scheduler.calls if c[0] == "alloc"]
    assert [len(pages) for pages in call[2]] == [3]          # the first chunk's 3 blocks, one group


def test_C3_build_once_per_scheduling_iteration_bound_before_start_load_kv():
    engine = engine_with(lambda r, n: (0, False))
    run(engine, Request(1, PROMPT, 3))
    builds, binds, starts = at("build_connector_meta"), at("bind"), at("start_load_kv")
    assert len(builds) == len(starts) == 3 == engine.stats.iterations   # prefill + 2 decode steps
    assert all(b < bind < s for b, bind, s in zip(builds, binds, starts, strict=True))


def test_C4_each_pass_loads_then_waits_and_saves_layer_by_layer_then_waits_for_save():
    engine = engine_with(lambda r, n: (0, False))
    run(engine, Request(1, PROMPT, 2))
    worker_hooks = [(h, a) for h, a in LOG if h in ("start_load_kv", "wait_for_layer_load", "save_kv_layer",
                                                    "wait_for_save")]
    one_pass = ([("start_load_kv", None)]
                + [(h, i) for i in range(LAYERS) for h in ("wait_for_layer_load", "save_kv_layer")]
                + [("wait_for_save", None)])
    assert worker_hooks == one_pass * 2


def test_C4_an_iteration_whose_requests_all_left_to_load_runs_no_forward_pass():
    engine = engine_with(lambda r, n: (8 * T, True))
    run(engine, Request(1, PROMPT, 2))
    first_get_finished = at("get_finished")[0]
    before = [h for h, _ in LOG[:first_get_finished]]
    assert before.count("build_connector_meta") == before.count("start_load_kv") == 1
    assert "wait_for_layer_load" not in before and "wait_for_save" not in before


def test_C5_request_finished_once_after_the_last_pass_before_get_finished():
    engine = engine_with(lambda r, n: (0, False))
    run(engine, Request(1, PROMPT, 2))
    (finished,) = at("request_finished_by_layer_group", 1)
    assert at("wait_for_save")[-1] < finished < at("get_finished")[-1]
    assert finished > at("get_finished")[-2]          # in the last iteration, before its get_finished


def test_C6_get_finished_every_iteration():
    engine = engine_with(lambda r, n: (4 * T, True))
    run(engine, Request(1, PROMPT, 3))
    assert len(at("get_finished")) == engine.stats.iterations > len(at("build_connector_meta")) - 1


def test_C7_every_offered_token_is_delivered_or_cancelled():
    engine = engine_with(lambda r, n: (len(r.get_tokens()) - n, False), local_reuse=True)
    run(engine, Request(1, PROMPT, 2))
    state = engine.states[1]
    assert engine.connector.scheduler.cancels() == [(1, len(PROMPT) - 1, len(PROMPT))]   # the last position
    assert state.request.py_num_connector_matched_tokens == len(PROMPT) - 1


# ---- RequestData --------------------------------------------------------------------------------

def test_D1_first_report_new_and_whole_later_reports_cached_deltas():
    engine = engine_with(lambda r, n: (0, False), chunk_size=4 * T)
    run(engine, Request(1, PROMPT, 3))
    (first, *later) = reports(engine)
    assert first[1] == "new" and first[2].new_tokens == list(PROMPT) and len(first[2].new_block_ids) == 4
    assert all(kind == "cached" for _, kind, _ in later)
    assert [len(d.new_tokens) for _, _, d in later] == [0, 0, 1, 1]   # 2 more chunks, then 2 decode steps
    (finished,) = [c for c in engine.connector.scheduler.calls if c[0] == "finished"]
    reported = [p for _, _, d in [first] + later for p in d.new_block_ids]
    assert reported == finished[2][0]                                # every page reported once, in order


def test_D2_one_list_per_layer_group_bad_page_index_in_place():
    engine = engine_with(lambda r, n: (30 * T, False), model="tiny-vswa", num_slots=128)
    run(engine, Request(1, tuple(range(1, 40 * T)), 2))   # loaded blocks the window passed get no page
    (_, _, data) = reports(engine)[0]
    groups = data.new_block_ids_by_layer_group
    assert len(groups) == 2 and data.new_block_ids == []
    assert len(set(map(len, groups))) == 1                             # positionally aligned
    assert any(BAD_PAGE_INDEX in g for g in groups) and not all(BAD_PAGE_INDEX in g for g in groups)
    single = engine_with(lambda r, n: (0, False))
    run(single, Request(1, PROMPT, 2))
    (_, _, data) = reports(single)[0]
    assert data.new_block_ids_by_layer_group == [data.new_block_ids]


def test_D3_sync_load_first_report_excludes_the_loaded_tokens():
    engine = engine_with(lambda r, n: (0, False) if r.request_id == 1 else (2 * T, False), local_reuse=True)
    run(engine, Request(1, PROMPT, 2))
    run(engine, Request(2, PROMPT[:8 * T] + (999,) * 9, 2))           # local match 8 blocks, then load 2
    (data,) = [d for _, kind, d in reports(engine) if kind == "new" and d.request_id == 2]
    assert engine.connector.scheduler.asks(2) == [("ask", 2, 8 * T)]
    matched = engine.states[2].request.py_num_connector_matched_tokens
    assert (data.computed_position, matched, data.num_scheduled_tokens) == (8 * T, 2 * T, 9 - 2 * T)


def test_D4_async_load_absent_while_loading_then_reported_new_including_the_loaded_tokens():
    engine = engine_with(lambda r, n: (6 * T, True))
    run(engine, Request(1, PROMPT, 2))
    outs = engine.connector.scheduler.outputs
    assert (outs[0].new_requests, outs[0].cached_requests) == ([], [])   # the load iteration
    (i, kind, data) = reports(engine)[0]
    assert (kind, data.request_id) == ("new", 1) and i > 0
    assert (data.computed_position, data.num_scheduled_tokens) == (6 * T, len(PROMPT) - 6 * T)
    assert data.new_tokens == list(PROMPT)


def test_D5_a_decode_step_is_cached_at_tokens_minus_one_scheduling_one():
    engine = engine_with(lambda r, n: (0, False))
    run(engine, Request(1, PROMPT, 3))
    decodes = [d for _, kind, d in reports(engine)[1:]]
    assert [(d.computed_position, d.num_scheduled_tokens) for d in decodes] == [(len(PROMPT), 1),
                                                                              (len(PROMPT) + 1, 1)]


def test_D6_no_hashes_no_priorities_the_salt_as_given():
    engine = engine_with(lambda r, n: (0, False))
    run(engine, Request(1, PROMPT, 2, cache_salt="alice"), Request(2, PROMPT[:T * 2], 2))
    datas = [d for _, _, d in reports(engine)]
    assert all(d.block_hashes == [] and d.priorities is None for d in datas)
    assert {d.request_id: d.cache_salt for d in datas} == {1: "alice", 2: None}


# ---- loads --------------------------------------------------------------------------------------

def test_L1_a_sync_load_is_read_by_the_same_pass():
    engine = engine_with(lambda r, n: (6 * T, False))
    run(engine, Request(1, PROMPT, 2))                 # run() asserts no integrity error: bytes read were right
    assert engine.stats.iterations == 2 and engine.states[1].request.py_num_connector_matched_tokens == 6 * T


def test_L2_an_async_load_is_named_in_get_finished_and_waits_for_its_report():
    engine = engine_with(lambda r, n: (6 * T, True))
    run(engine, Request(1, PROMPT, 2))
    calls = [a for h, a in LOG if h == "get_finished"]
    assert calls[0] == ([], [1]) and calls[1] == ([], [])   # given once, in the load iteration
    # OracleWorker reports the load at its second poll: the request's first pass comes after it
    assert at("get_finished")[1] < at("wait_for_layer_load")[0]
    assert engine.states[1].request.py_num_connector_matched_tokens == 6 * T


# ---- saves --------------------------------------------------------------------------------------

class SavesReportedLateWorker(LoggingWorker):
    """Reports an asynchronous save one get_finished call after it was given."""

    def __init__(self, llm_args):
        super().__init__(llm_args)
        self._late: list[int] = []

    def get_finished(self, finished_gen_req_ids, started_loading_req_ids):
        LOG.append(("get_finished", (list(finished_gen_req_ids), list(started_loading_req_ids))))
        _, loaded = OracleWorker.get_finished(self, [], started_loading_req_ids)
        saved, self._late = self._late, list(finished_gen_req_ids)
        return saved, loaded


def held_after_each_iteration(engine, *requests):
    """Whether the manager still held pages for a finished request after each iteration."""
    held = []
    for r in requests:
        engine.add_request(r)
    engine.run(on_iteration=lambda e: held.append(bool(e.manager.holds)))
    assert engine.stats.failures == [] and engine.integrity_errors == 0
    return held


def test_S1_pages_are_released_after_the_last_pass_unless_finished_answers_true():
    engine = engine_with(lambda r, n: (0, False))
    assert held_after_each_iteration(engine, Request(1, PROMPT, 2)) == [False, False]
    assert engine.manager.caches == []


def test_S2_an_async_save_holds_the_pages_until_get_finished_reports_it():
    LOG.clear()
    engine = make_engine(scripted(lambda r, n: (0, False), True, worker=SavesReportedLateWorker), tpb=T)
    for hook in ("request_finished_by_layer_group",):
        sched = engine.connector.scheduler
        setattr(sched, hook, _logged(hook, getattr(type(sched), hook)).__get__(sched))
    assert held_after_each_iteration(engine, Request(1, PROMPT, 2)) == [False, True, False]
    (finished,) = at("request_finished_by_layer_group", 1)
    next_poll = min(i for i in at("get_finished") if i > finished)
    assert LOG[next_poll][1][0] == [1]                 # given in the same iteration as request_finished
    assert engine.states[1].phase is Phase.DONE


def test_S3_an_id_returned_before_it_was_given_is_a_violation():
    class EagerWorker(LoggingWorker):
        def get_finished(self, finished_gen_req_ids, started_loading_req_ids):
            super().get_finished(finished_gen_req_ids, started_loading_req_ids)
            return [42], []
    LOG.clear()
    engine = make_engine(scripted(lambda r, n: (0, False), worker=EagerWorker), tpb=T)
    engine.add_request(Request(1, PROMPT, 2))
    engine.run()
    kinds = {v.check.value for v in engine.connector.violations}
    assert "unknown-save-id" in kinds


# ---- the store ----------------------------------------------------------------------------------

MODULE_STORE = "tests.helpers.module_store_connector:ModuleStoreScheduler:ModuleStoreWorker"
EARLIER_ENGINE = ("the connector serves what an earlier engine saved. A store must live no longer than the "
                  "connector objects (one engine)")
RANK_1_LACKS = "rank 1's store lacks what the scheduler's index (kept from an earlier engine) offered: request"


def _evidence(results, check):
    (found,) = [r for r in results if r.check == check]
    assert found.failed, found
    return found.evidence


def test_T1_a_store_in_module_dicts_serves_an_earlier_engine_on_one_rank_said_in_words():
    module_store_connector.forget()
    results = run_isolated("chunked-prefill", Context(load_connector(MODULE_STORE), "tiny"), timeout=120)
    assert any(EARLIER_ENGINE in e for e in _evidence(results, "integrity"))


def test_T1_on_two_ranks_rank_1_lacks_what_the_index_kept_from_an_earlier_engine_claims():
    """A bare KeyError on rank 1 used to be all the evidence, in chunked-prefill and hook-raises."""
    module_store_connector.forget()
    ctx = Context(load_connector(MODULE_STORE), "tiny", num_ranks=2, tp_size=2)
    results = run_all([ctx], ["chunked-prefill", "hook-raises"], 120)
    for scenario, check in (("chunked-prefill", "integrity"), ("hook-raises", "survives-hook-failure")):
        evidence = _evidence([r for r in results if r.scenario == scenario], check)
        assert evidence[0].startswith(RANK_1_LACKS), evidence
        assert "no request of this engine had computed block" in evidence[0]
        assert "rank 1's start_load_kv raised KeyError" in evidence[0]
        assert not [e for e in evidence[1:] if "KeyError" in e], evidence   # the bare line is gone


def test_T1_the_example_on_two_ranks_is_not_said_to_keep_a_store():
    """The shipped example keeps its store on its objects: nothing of the above is said about it."""
    ctx = Context(load_connector(f"{EXAMPLE}:DictConnectorScheduler:DictConnectorWorker"), "tiny", num_ranks=2,
                  tp_size=2)
    results = run_all([ctx], ["chunked-prefill", "hook-raises"], 120)
    assert not [r for r in results if r.failed], [r for r in results if r.failed]


def test_T1_a_user_set_connector_cache_folder_is_said_once_and_each_engine_gets_its_own(tmp_path):
    """TensorRT-LLM's file examples read CONNECTOR_CACHE_FOLDER; one set by the user would be one
    store for every engine of the run. The verdicts are those of a run without it, and the user's
    folder stays empty."""
    target = f"{ROOT / 'tests/helpers/cache_folder_connector.py'}:CacheFolderLeader:BlockFilesWorker"
    user = tmp_path / "user-folder"
    user.mkdir()
    runs = {}
    for name, extra in (("without", {}), ("with", {"CONNECTOR_CACHE_FOLDER": str(user)})):
        env = {k: v for k, v in os.environ.items() if k != "CONNECTOR_CACHE_FOLDER"} | extra
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        runs[name] = subprocess.run([sys.executable, "-m", "kvtool", "validate", "--compat", "trtllm", target,
                                     "--model", "tiny", "--scenario", "chunked-prefill", "--scenario", "cold-warm",
                                     "--format", "json"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                                    env=env)
    verdicts = {name: [(r["scenario"], r["check"], r["verdict"]) for r in json.loads(done.stdout)["results"]]
                for name, done in runs.items()}
    assert verdicts["with"] == verdicts["without"]
    assert ("cold-warm", "warm-hit", "pass") in verdicts["with"]
    said = [line for line in runs["with"].stderr.splitlines() if "CONNECTOR_CACHE_FOLDER=" in line]
    assert said == [f"kvtool: CONNECTOR_CACHE_FOLDER={user} is set: a connector keeping its store in that folder "
                    "would share one store between every engine this run starts, and each must start with a cold "
                    "store (an earlier engine's blocks would be served, or fail to load, on a later one); validate "
                    "points it at a fresh folder of each engine's own instead, and leaves yours untouched"]
    assert "CONNECTOR_CACHE_FOLDER" not in runs["without"].stderr
    assert list(user.iterdir()) == []


def test_T1_engine_store_folders_point_inside_the_current_folder_and_restore(tmp_path, monkeypatch):
    monkeypatch.setenv("CONNECTOR_CACHE_FOLDER", "/somewhere/of/yours")
    monkeypatch.delenv("TLLM_CONNECTOR_CACHE_FOLDER", raising=False)
    monkeypatch.chdir(tmp_path)
    with engine_store_folders():
        assert os.environ["CONNECTOR_CACHE_FOLDER"] == str(tmp_path / "connector_cache_folder")
        assert (tmp_path / "connector_cache_folder").is_dir() and "TLLM_CONNECTOR_CACHE_FOLDER" not in os.environ
    assert os.environ["CONNECTOR_CACHE_FOLDER"] == "/somewhere/of/yours"


# ---- the guide and this file --------------------------------------------------------------------

def test_every_rule_has_a_test_and_every_test_a_rule():
    rules = set(re.findall(r"^- \*\*([A-Z]\d+)\*\*", GUIDE.read_text(), re.M))
    tested = {m.group(1) for name in dir(sys.modules[__name__]) if (m := re.match(r"test_([A-Z]\d+)_", name))}
    assert rules and rules == tested, (sorted(rules - tested), sorted(tested - rules))
