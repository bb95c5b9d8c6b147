"""validate gives one verdict per seed and finds timing bugs by construction: a save reported
before its copy landed, loads written into the pages of an allocation a pause took back."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.connector.loader import ConnectorSpec
from kvtool.connectors.host import HostConnectorScheduler
from kvtool.validate.harness import Context
from kvtool.validate.runner import run_scenario
from kvtool.validate.schedule import schedule_for
from tests.helpers.early_report_connectors import (
    ClaimsOneBlockMore,
    EarlyReport,
    EarlyReportWorker,
    RecordsAllocations,
    ReplaysIntoOldPages,
    ReportsLanded,
    WaitsInGetFinished,
    Worker,
)

MODULE = "tests.helpers.early_report_connectors"
cli = CliRunner()
EARLY = ConnectorSpec("early-report", EarlyReport, EarlyReportWorker, MODULE)


def verdicts(spec: ConnectorSpec, scenario: str, seed: int = 0, model: str = "tiny") -> frozenset:
    return frozenset((r.scenario, r.model, r.check, r.verdict.value)
                     for r in run_scenario(scenario, Context(spec, model, seed=seed)))


def test_an_early_reported_save_fails_every_run_at_one_seed_with_one_verdict_set():
    runs = {verdicts(EARLY, "async-save") for _ in range(20)}
    assert runs == {frozenset({("async-save", "tiny", "load-completes", "pass"),
                               ("async-save", "tiny", "finished-ids", "pass"),
                               ("async-save", "tiny", "integrity", "fail")})}


def test_an_early_reported_save_fails_on_every_seed():
    failed = [seed for seed in range(20)
              if ("async-save", "tiny", "integrity", "fail") in verdicts(EARLY, "async-save", seed)]
    assert failed == list(range(20))


def test_the_same_connector_reporting_after_its_copies_landed_passes():
    correct = ConnectorSpec("host-async", EarlyReport, ReportsLanded, MODULE)
    assert {v for _, _, _, v in verdicts(correct, "async-save")} == {"pass"}


def test_a_get_finished_that_waits_for_its_copies_is_let_through_the_gate():
    waits = ConnectorSpec("waits", EarlyReport, WaitsInGetFinished, MODULE)
    assert {v for _, _, _, v in verdicts(waits, "async-save")} == {"pass"}


def _pause_run(scheduler):
    """The pause-replay scenario's checks and its engine run (the scenario's last)."""
    import kvtool.validate.pause_scenarios as pause
    runs = []
    original = pause.run

    def keep(*args, **kwargs):
        runs.append(original(*args, **kwargs))
        return runs[-1]

    pause.run = keep
    try:
        results = run_scenario("pause-replay", Context(ConnectorSpec("x", scheduler, Worker, MODULE), "tiny"))
    finally:
        pause.run = original
    return results, runs[-1]


def test_a_paused_request_replays_in_other_pages_and_is_served_by_the_connector():
    results, r = _pause_run(RecordsAllocations)
    assert {c.verdict.value for c in results} == {"pass"}
    (paused,) = [rid for rid, s in r.outcomes.items() if s.num_pauses]
    first, replay = [pages for rid, pages in RecordsAllocations.latest.allocations if rid == paused]
    assert set(replay[0][:len(first[0])]) != set(first[0])
    assert r.outcome(paused).num_external > 0 and r.outcome(paused).num_local_hit == 0
    assert any(line.startswith(f"exercised: request {paused}'s replay ran in pages other")
               for line in results[0].evidence)


def test_loads_planned_into_the_pages_a_pause_took_back_fail_integrity():
    results, r = _pause_run(ReplaysIntoOldPages)
    (integrity,) = [c for c in results if c.check == "integrity"]
    assert integrity.verdict.value == "fail"
    assert any("this position was loaded by the connector" in line for line in integrity.evidence)


@pytest.mark.parametrize("scheduler", [HostConnectorScheduler])
def test_host_passes_the_lifetime_scenarios(scheduler):
    spec = ConnectorSpec("host", scheduler, Worker, MODULE)
    for scenario in ("pause-replay", "free-before-delivery", "final-pass-blocks"):
        assert {v for _, _, _, v in verdicts(spec, scenario)} <= {"pass", "skip"}, scenario


# ---- evidence that names the cause ---------------------------------------------------------------
def _integrity(spec: ConnectorSpec, scenario: str):
    (check,) = [r for r in run_scenario(scenario, Context(spec, "tiny")) if r.check == "integrity"]
    assert check.failed
    return check.evidence


def test_an_early_report_is_said_to_come_before_the_bytes_were_in_the_store():
    evidence = _integrity(EARLY, "async-save")
    assert any("get_finished reported that save at iteration" in e and "before its bytes were in the store" in e
               for e in evidence), evidence
    assert not any("answer True from request_finished" in e for e in evidence)


def test_an_offer_of_a_block_nobody_stored_says_the_index_claimed_it():
    evidence = _integrity(ConnectorSpec("claims", ClaimsOneBlockMore, Worker, MODULE), "cold-warm")
    assert any(re.search(r"block \d+, nor had any earlier engine: no request stored block \d+, yet the connector's "
                         "index claimed it", e) for e in evidence), evidence
    assert not any("earlier engine saved" in e for e in evidence)


# ---- --seed and --explore on the command line ------------------------------------------------
def test_the_seed_is_in_the_summary_json_and_junit(tmp_path):
    result = cli.invoke(app, ["validate", "host", "--scenario", "clamp", "--model", "tiny", "--seed", "7",
                              "--format", "json", "--junit", str(tmp_path / "j.xml")])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["seed"] == 7 and document["schedule"] == schedule_for(7).describe()
    assert "; seed 7" in result.stderr
    assert '<property name="seed" value="7" />' in (tmp_path / "j.xml").read_text()


def test_explore_stops_a_scenario_at_its_first_failure_and_prints_the_reproduce_command():
    target = "tests/helpers/early_report_connectors.py:EarlyReport:EarlyReportWorker"
    result = cli.invoke(app, ["validate", target, "--scenario", "async-save", "--scenario", "clamp", "--model", "tiny",
                              "--runtime", "trtllm-v2-release", "--explore", "3", "--seed", "4", "--device", "cpu",
                              "--format", "json"])
    assert result.exit_code == 1
    runs = re.findall(r"^seeds? ([\d.]+) (again, alone: )?(async-save|clamp)\[tiny, trtllm-v2-release\]", result.stderr,
                      re.MULTILINE)
    # async-save stops at its first seed and runs once more alone; clamp passes all three (not shrink's probes)
    assert runs == [("4", "", "async-save"), ("4..6", "", "clamp"), ("4", "again, alone: ", "async-save")]
    assert (f"async-save[tiny, trtllm-v2-release] failed integrity at seed 4 ({schedule_for(4).describe()}); "
            f"reproduce: kvtool validate {target} --scenario async-save --model tiny --runtime trtllm-v2-release "
            "--seed 4 --device cpu") in result.stderr
    assert "seeds 4..6 explored, 1 scenario failed" in result.stderr
    document = json.loads(result.stdout)   # the failure's results are the fresh process's, at its seed
    assert {r["seed"] for r in document["results"] if r["scenario"] == "async-save"} == {4}
    assert [(f["seed"], f["alone"]) for f in document["findings"]] == [(4, True)]


def test_explore_runs_a_scenarios_seeds_in_one_process_and_says_when_a_failure_needs_the_earlier_ones():
    target = "tests/helpers/early_report_connectors.py:WrongFromTheSecondEngine:Worker"
    result = cli.invoke(app, ["validate", target, "--scenario", "cold-warm", "--model", "tiny", "--runtime",
                              "trtllm-v2-release", "--explore", "3", "--device", "cpu", "--format", "json"])
    assert result.exit_code == 1
    # seed 0 built the process's first engine and passed; seed 1's engine was its second, and failed
    assert re.findall(r"^seeds? ([\d.]+) (again, alone: )?cold-warm", result.stderr, re.MULTILINE) == \
        [("1", ""), ("1", "again, alone: ")]
    assert ("cold-warm[tiny, trtllm-v2-release] failed integrity at seed 1 only after the earlier seeds ran in the "
            "same process" in result.stderr)
    assert ("reproduce: kvtool validate tests/helpers/early_report_connectors.py:WrongFromTheSecondEngine:Worker "
            "--scenario cold-warm --model tiny --runtime trtllm-v2-release --seed 0 --explore 2 --device cpu"
            ) in result.stderr
    assert "cold-warm[tiny, trtllm-v2-release]: not shrunk (it does not fail alone at its seed)" in result.stderr
    document = json.loads(result.stdout)
    assert [(f["seed"], f["alone"], f["max_requests"]) for f in document["findings"]] == [(1, False, None)]
    assert {r["seed"] for r in document["results"] if r["scenario"] == "cold-warm"} == {1}
