"""`--compat vllm`: vLLM 0.32.0's own scheduler driven with kvtool's fingerprinting workers.

Skipped where vLLM is not installed (`pip install -e '.[vllm]'`). Scenarios run in this process
(`validation.run_here`), each in its own folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtool.vllm_compat.install import vllm_available

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (pip install -e '.[vllm]')")

HELPERS = Path(__file__).parent / "helpers" / "broken_vllm_connectors.py"


def run(target: str, scenario: str, model: str, tmp_path: Path, **options: str):
    from kvtool.vllm_compat.scenarios import VllmContext
    from kvtool.vllm_compat.target import parse_target
    from kvtool.vllm_compat.validation import run_here

    ctx = VllmContext(parse_target(target, options), model, folder=tmp_path)
    return {(r.check): r for r in run_here(scenario, ctx)}


def test_planted_bugs_are_listed_for_every_bug_class():
    from tests.helpers.broken_vllm_connectors import FAILS

    scenarios = {scenario for scenario, _, _ in FAILS.values()}
    assert {"ask-again", "async-load", "load-error-recompute", "preemption", "delay-free", "empty-step",
            "hybrid"} <= scenarios


@pytest.mark.parametrize("name", ["ShiftedLoad", "AskSideEffects", "EarlyRecv", "SilentLoadFailure",
                                  "LateErrorReport", "AppendsResumedBlocks", "SendBeforeSaved", "SkipsEmptySteps",
                                  "FlattensGroups"])
def test_a_planted_bug_fails_its_scenario_at_the_default_seed(name, tmp_path):
    from tests.helpers.broken_vllm_connectors import FAILS

    scenario, model, check = FAILS[name]
    rows = run(f"{HELPERS}:{name}", scenario, model, tmp_path)
    assert rows[check].failed, rows[check].evidence
    clean = run("kvtool-host", scenario, model, tmp_path / "clean")
    assert not any(r.failed for r in clean.values()), {k: r.evidence for k, r in clean.items()}


def test_a_connector_that_asks_the_tensor_parallel_group_registers_and_serves(tmp_path):
    target = f"{Path(__file__).parent / 'helpers' / 'group_asking_vllm_connector.py'}:AsksTensorParallelGroup"
    rows = run(target, "cold-warm", "tiny", tmp_path)
    assert {check: r.verdict.value for check, r in rows.items()} == {
        "integrity": "pass", "requests-finish": "pass", "finished-ids": "pass", "holds-nothing": "pass",
        "warm-hit": "pass"}
    assert set(_seen_by_file_module()) == {(0, 1)}


def _seen_by_file_module() -> list[tuple[int, int]]:
    """What the connector recorded: it runs from its file's own module (`target.parse_target`)."""
    import sys

    modules = [m for name, m in sys.modules.items() if name.startswith("kvtool_vllm_target_")
               and hasattr(m, "AsksTensorParallelGroup")]
    return [seen for m in modules for seen in m.AsksTensorParallelGroup.seen]


def test_the_store_bench_measures_kvtool_host_through_vllm_beside_the_reference(tmp_path):
    from kvtool.bench.protocol_engine import QUICK
    from kvtool.bench.protocol_suite import reference_connector
    from kvtool.vllm_compat.entry import run_vllm_store

    rows, problems = run_vllm_store("kvtool-host", {}, "tiny", [16], QUICK, 1, 1, reference_connector("cpu"))
    assert problems == []
    got = {(r.connector, r.direction): (r.blocks, r.verified) for r in rows}
    assert got == {("kvtool-host (vLLM)", "save"): (16, True), ("kvtool-host (vLLM)", "load"): (16, True),
                   ("host (kvtool reference, backend torch)", "save"): (16, True),
                   ("host (kvtool reference, backend torch)", "load"): (16, True)}
    assert all(r.gbps > 0 and r.vs_reference is not None for r in rows)
    assert [r.vs_reference for r in rows[2:]] == [1.0, 1.0]


def test_the_store_bench_reports_a_connector_that_serves_nothing(tmp_path):
    from kvtool.bench.protocol_engine import QUICK
    from kvtool.bench.protocol_suite import reference_connector
    from kvtool.vllm_compat.entry import run_vllm_store

    rows, problems = run_vllm_store(f"{HELPERS}:NeverHits", {}, "tiny", [16], QUICK, 1, 1,
                                    reference_connector("cpu"))
    assert [r.blocks for r in rows[:2]] == [16, 0]
    assert problems == [f"{HELPERS}:NeverHits (vLLM), 16 tokens per block: the connector served nothing in the "
                        "warm round"]


@pytest.mark.parametrize("scenario", ["delay-free", "empty-step", "workers"])
def test_kvtool_host_serves_the_repeat_of_a_delayed_save_on_the_hybrid_model(scenario, tmp_path):
    """Saved at the end, a sliding-window group's early blocks would be gone (freed as the window
    moved): kvtool-host saves them as they complete and defers only the hold and the report."""
    rows = run("kvtool-host", scenario, "tiny-vswa", tmp_path)
    assert {check: r.verdict.value for check, r in rows.items()} == {
        "integrity": "pass", "requests-finish": "pass", "finished-ids": "pass", "holds-nothing": "pass",
        "warm-hit": "pass"}
    assert rows["warm-hit"].evidence == ["request warm scheduled with 36 of 38 prompt tokens computed"]


def _shared_prefix_trace(target: str) -> dict:
    from kvtool.vllm_compat.entry import run_vllm_trace
    from kvtool.vllm_compat.trace_replay import VllmTraceShape
    from kvtool.workloads.source import open_workload

    requests = open_workload(Path(__file__).parents[1] / "workloads" / "shared_prefix.jsonl").requests()
    return run_vllm_trace(target, {}, requests, "tiny", VllmTraceShape(16, 41, 64, 8192))


def test_a_trace_through_kvtool_host_is_served_by_the_connector_and_vllms_cache():
    from kvtool.vllm_compat.trace_replay import UNREAD

    s = _shared_prefix_trace("kvtool-host")
    assert (s["num_requests"], s["prompt_tokens"], s["generated_tokens"]) == (24, 7408, 192)
    assert s["integrity_errors"] == s["failed_requests"] == s["invariant_errors"] == 0
    assert s["connector_hit_tokens"] > 0 and s["local_hit_tokens"] > 0
    hits = s["local_hit_tokens"] + s["connector_hit_tokens"]
    assert s["computed_tokens"] == (7408 - hits) + (192 - 24) + s["recomputed_tokens"]
    assert s["gpu_pool_tokens"] == 640 and s["runtime"] == "vllm" and s["connector"] == "kvtool-host"
    assert all(s[key] is None for key in UNREAD)


def test_a_trace_through_a_connector_that_never_hits_reads_no_connector_tokens():
    s = _shared_prefix_trace(f"{HELPERS}:NeverHits")
    assert s["connector_hit_tokens"] == 0 and s["integrity_errors"] == 0
    assert s["computed_tokens"] == (7408 - s["local_hit_tokens"]) + (192 - 24) + s["recomputed_tokens"]
