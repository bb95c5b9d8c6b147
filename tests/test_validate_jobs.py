"""`kvtool validate --jobs N`: scenarios in processes at once, reported as one at a time would be;
a model's registration first; the scenarios that disrupt the --remote server alone."""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.connector.loader import ConnectorSpec
from kvtool.connectors.host import HostConnectorScheduler, HostConnectorWorker
from kvtool.connectors.registry import load_connector
from kvtool.manager.layer_groups import plan_layer_groups
from kvtool.manager.pool_groups import placed_bytes, plan_pool_groups
from kvtool.models import load_model
from kvtool.validate import runner as runner_module
from kvtool.validate.harness import MAX_SLOTS, Context
from kvtool.validate.remote_scenarios import REMOTE_SCENARIOS
from kvtool.validate.results import CheckResult, Verdict
from kvtool.validate.runner import (
    SCENARIO_GPU_OVERHEAD_BYTES,
    SETUP,
    Schedule,
    Task,
    gpu_jobs_cap,
    max_jobs,
    next_task,
    plan,
    run_all,
)
from tests.helpers.broken_connectors import BROKEN
from tests.helpers.lingering_child import lingering_child, lingering_options

runner = CliRunner()
REPO = Path(__file__).resolve().parent.parent
REMOTE = [s.name for s in REMOTE_SCENARIOS]
SMALL_STORE = (("capacity", "8MiB"),)   # as tests/test_validate.py: the same checks fail, faster


def _context(model: str = "tiny", remote: str | None = None) -> Context:
    return Context(None, model, remote=remote)


def _passed(task: Task) -> list[CheckResult]:
    return [CheckResult(task.name, str(task.model), "registration" if task.name == SETUP else "integrity",
                        Verdict.PASS)]


def _simulate(schedule: Schedule, jobs: int, seed: int, outcome=_passed):
    """Drive `schedule` as `run_all` does, finishing a random task in flight each step. Returns the
    tasks in the order they started, every set in flight, and the result lists in reported order."""
    rng = random.Random(seed)
    started, in_flight, reported = [], [], []
    flight: list[Task] = []
    while not schedule.done:
        while len(flight) < jobs and (task := schedule.take()) is not None:
            flight.append(task)
            started.append(task)
            in_flight.append(list(flight))
        done = flight.pop(rng.randrange(len(flight)))
        reported += schedule.finish(done, outcome(done))
    return started, in_flight, reported


# ---- planning (no processes) -------------------------------------------------------------------
def test_the_plan_is_the_serial_order_and_only_remote_scenarios_given_a_server_run_alone():
    names = ["cold-warm", *REMOTE, "contract"]
    tasks = plan([_context("tiny"), _context("tiny-vswa", "redis://127.0.0.1:1/0")], names)
    assert [(t.index, t.model, t.name) for t in tasks] == [
        (i, m, name) for i, (m, name) in enumerate((m, n) for m in (0, 1) for n in [SETUP] + names)]
    assert [t.name for t in tasks if t.alone] == REMOTE
    assert all(t.model == 1 for t in tasks if t.alone)


def test_one_job_starts_every_task_in_the_serial_order():
    tasks = plan([_context("tiny", "redis://x"), _context("tiny-vswa", "redis://x")], ["cold-warm", *REMOTE])
    started, _, reported = _simulate(Schedule(tasks), jobs=1, seed=0)
    assert started == tasks
    assert [r[0].scenario for r in reported] == [t.name for t in tasks]


@pytest.mark.parametrize("seed", range(5))
def test_with_a_remote_server_its_disruptive_scenarios_never_share_the_machine(seed):
    names = ["cold-warm", *REMOTE, "contract", "concurrency"]
    tasks = plan([_context(m, "redis://x") for m in ("tiny", "tiny-vswa")], names)
    started, in_flight, _ = _simulate(Schedule(tasks), jobs=4, seed=seed)
    assert sorted(started, key=lambda t: t.index) == tasks
    assert max(map(len, in_flight)) == 4      # the others do run at once
    for flight in in_flight:
        assert not any(t.alone for t in flight) or len(flight) == 1, flight


def test_an_alone_task_waits_for_the_machine_to_empty_and_blocks_the_rest():
    tasks = plan([_context("tiny", "redis://x")], ["cold-warm", REMOTE[0], "contract"])
    setup, cold_warm, remote, contract = tasks
    assert next_task([remote, contract], {cold_warm}, {0}) is contract
    assert next_task([remote, contract], set(), {0}) is remote
    assert next_task([contract], {remote}, {0}) is None


def test_scenarios_wait_for_their_models_registration():
    tasks = plan([_context("tiny"), _context("tiny-vswa")], ["cold-warm", "contract"])
    assert next_task(tasks, set(), set()) is tasks[0]
    assert next_task(tasks[1:], {tasks[0]}, set()) is tasks[3]             # the other model's registration
    assert next_task(tasks[1:3] + tasks[4:], {tasks[0], tasks[3]}, set()) is None
    started, _, _ = _simulate(Schedule(tasks), jobs=4, seed=1)
    for task in started:
        if task.name != SETUP:
            assert started.index(tasks[3 * task.model]) < started.index(task)


@pytest.mark.parametrize("seed", range(3))
def test_a_refused_layout_runs_nothing_else_for_its_model_and_the_report_keeps_the_serial_order(seed):
    tasks = plan([_context("tiny"), _context("tiny-vswa")], ["cold-warm", "contract", "cache-salt"])

    def refuse_model_0(task: Task) -> list[CheckResult]:
        results = _passed(task)
        if task.name == SETUP and task.model == 0:
            results[0].verdict = Verdict.FAIL
        return results
    started, _, reported = _simulate(Schedule(tasks), jobs=3, seed=seed, outcome=refuse_model_0)
    assert [t.index for t in started if t.model == 0] == [0]
    assert [(r[0].model, r[0].scenario) for r in reported] == [("0", SETUP)] + [
        ("1", t.name) for t in tasks if t.model == 1]


# ---- the command -------------------------------------------------------------------------------
def _rows(document: dict) -> list[tuple]:
    return [(r["scenario"], r["model"], r["check"], r["verdict"], r["evidence"]) for r in document["results"]]


def test_two_jobs_report_what_one_does_in_the_same_order(tmp_path):
    runs = {}
    for jobs in ("1", "2"):
        result = runner.invoke(app, ["validate", "host", "--model", "tiny", "--model", "tiny-vswa",
                                     "--scenario", "cold-warm", "--scenario", "chunked-prefill",
                                     "--jobs", jobs, "--output", str(tmp_path / jobs)])
        assert result.exit_code == 0, result.output
        progress = [line for line in result.stderr.splitlines() if "[tiny" in line]
        runs[jobs] = progress, _rows(json.loads((tmp_path / jobs / "results.json").read_text()))
    assert runs["2"] == runs["1"]
    # every runtime: three of each model's setup and two scenarios, but V1 refuses tiny-vswa at setup
    assert len(runs["1"][0]) == 16 and len(runs["1"][1]) == 21
    assert json.loads((tmp_path / "2" / "meta.json").read_text())["jobs"] == min(2, max_jobs())


def test_a_broken_connector_fails_the_same_checks_with_two_jobs():
    scheduler, worker = BROKEN["integrity (chunked prefill)"]
    spec = load_connector(f"tests.helpers.broken_connectors:{scheduler}:{worker}")
    contexts = [Context(spec, m, options=SMALL_STORE) for m in ("tiny", "tiny-vswa")]
    verdicts = {}
    for jobs in (1, 2):
        results = run_all(contexts, ["cold-warm", "chunked-prefill"], 60, jobs=jobs)
        verdicts[jobs] = [(r.scenario, r.model, r.check, r.verdict, r.evidence) for r in results]
    assert verdicts[2] == verdicts[1]
    assert {(s, m, c) for s, m, c, v, _ in verdicts[2] if v is Verdict.FAIL} == {
        ("chunked-prefill", "tiny", "integrity"), ("chunked-prefill", "tiny-vswa", "integrity")}


RENDEZVOUS = "KVTOOL_TEST_RENDEZVOUS"


class MeetsAnotherScenario(HostConnectorScheduler):
    """The host connector whose first ask in a process waits (120 s at most, then raises) for the
    first ask of another process: its scenarios pass only when two of them run at once. The limit
    is a hang guard, far above how long another process takes to start on a loaded machine."""

    met = False

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if not MeetsAnotherScenario.met:
            _meet(Path(os.environ[RENDEZVOUS]))
            MeetsAnotherScenario.met = True
        return super().get_num_new_matched_tokens(request, num_computed_tokens)


def _meet(folder: Path) -> None:
    (folder / str(os.getpid())).touch()
    deadline = time.monotonic() + 120
    while not any(p.name != str(os.getpid()) for p in folder.iterdir()):
        if time.monotonic() > deadline:
            raise RuntimeError("no scenario of another process asked at the same time")
        time.sleep(0.01)


def test_two_jobs_run_two_scenario_processes_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv(RENDEZVOUS, str(tmp_path))
    spec = ConnectorSpec("meets", MeetsAnotherScenario, HostConnectorWorker, "tests", {})
    results = run_all([Context(spec, "tiny")], ["cold-warm", "multi-turn"], 300, jobs=2)
    assert not [(r.scenario, r.check, r.evidence[:2]) for r in results if r.failed]
    assert len(list(tmp_path.iterdir())) == 2


def test_a_dead_or_hung_scenario_is_still_an_error_with_two_jobs():
    dies = load_connector("tests.helpers.dying_connector:DiesAtAsk:HostConnectorWorker")
    results = run_all([Context(dies, "tiny")], ["cold-warm", "multi-turn"], 60, jobs=2)
    assert [(r.scenario, r.verdict, r.evidence) for r in results[1:]] == [
        (name, Verdict.ERROR, ["the scenario's process died (exit code 7)"]) for name in ("cold-warm", "multi-turn")]
    hangs = ConnectorSpec("hangs", HostConnectorScheduler, HangsAtLoad, "tests", {})
    started = time.perf_counter()
    results = run_all([Context(hangs, "tiny")], ["cold-warm", "multi-turn"], 2, jobs=2)
    assert [(r.scenario, r.verdict, r.evidence) for r in results[1:]] == [
        (name, Verdict.ERROR, ["did not finish within 2 s (a connector hook hung?)"])
        for name in ("cold-warm", "multi-turn")]
    assert time.perf_counter() - started < HANG_S / 2, "waited for the hung hooks"


HANG_S = 3600


class HangsAtLoad(HostConnectorWorker):
    def start_load_kv(self, stream):
        if self.meta.loads:
            time.sleep(HANG_S)
        super().start_load_kv(stream)


def _lingering_host(options: dict[str, str]) -> ConnectorSpec:
    return ConnectorSpec("host", HostConnectorScheduler, HostConnectorWorker, "kvtool.connectors.host", options)


def test_the_next_scenario_starts_while_a_finished_one_is_still_ending(tmp_path, monkeypatch):
    """With one job, the registration's process lingers after sending its results (as a child's
    CUDA teardown does): the scenario after it starts beside it, and every process is collected."""
    monkeypatch.setattr(runner_module, "_child", lingering_child)
    spec = _lingering_host(lingering_options(tmp_path, SETUP, 30))
    results = run_all([Context(spec, "tiny")], ["cold-warm"], 60, jobs=1)
    assert not [r for r in results if r.verdict != Verdict.PASS]
    assert (tmp_path / "overlapped").exists()
    assert len(list(tmp_path.glob("started-*"))) == 2
    assert not multiprocessing.active_children()


def test_without_overlap_the_next_scenario_starts_only_once_the_finished_one_has_ended(tmp_path, monkeypatch):
    """`--no-overlap`: the registration's process lingers (until another starts, at most 3 s); the
    next scenario waits for it, so it never sees another child start, and ends by its own timer."""
    monkeypatch.setattr(runner_module, "_child", lingering_child)
    spec = _lingering_host(lingering_options(tmp_path, SETUP, 3))
    started = time.monotonic()
    results = run_all([Context(spec, "tiny")], ["cold-warm"], 60, jobs=1, overlap=False)
    assert not [r for r in results if r.verdict != Verdict.PASS]
    assert not (tmp_path / "overlapped").exists() and len(list(tmp_path.glob("started-*"))) == 2
    assert time.monotonic() - started >= 3      # the linger was waited out, not cut by the next start
    assert not multiprocessing.active_children()


def test_a_finished_scenario_that_never_ends_is_killed_once_its_grace_has_passed(tmp_path, monkeypatch):
    """Counted from its answer, checked while the run goes on (`ended`), not only at the run's end.
    The grace is an hour while it must not be over yet, then a second that is waited out from the
    answer: no wall-clock race between the answer and the first look."""
    monkeypatch.setattr(runner_module, "_child", lingering_child)
    monkeypatch.setattr(runner_module, "EXIT_GRACE_S", 3600.0)
    spec = _lingering_host(lingering_options(tmp_path, "cold-warm", 3600, until="never"))
    process = runner_module.ScenarioProcess("cold-warm", Context(spec, "tiny"), 300)
    assert {r.verdict for r in process.result()} == {Verdict.PASS}
    assert not process.ended()
    monkeypatch.setattr(runner_module, "EXIT_GRACE_S", 1.0)
    while time.perf_counter() <= process.answered_at + 1.0:
        time.sleep(0.05)
    assert process.ended()
    with pytest.raises(ProcessLookupError):
        os.kill(int((tmp_path / "lingering-pid").read_text()), 0)


def test_a_run_ends_with_every_lingering_scenario_process_gone(tmp_path, monkeypatch):
    monkeypatch.setattr(runner_module, "_child", lingering_child)
    monkeypatch.setattr(runner_module, "EXIT_GRACE_S", 0.5)
    spec = _lingering_host(lingering_options(tmp_path, "cold-warm", 3600, until="never"))
    results = run_all([Context(spec, "tiny")], ["cold-warm"], 60, jobs=1)
    assert {r.scenario for r in results} == {SETUP, "cold-warm"} and {r.verdict for r in results} == {Verdict.PASS}
    assert not multiprocessing.active_children()
    with pytest.raises(ProcessLookupError):
        os.kill(int((tmp_path / "lingering-pid").read_text()), 0)


def test_an_interrupted_run_kills_the_finished_scenarios_at_once(tmp_path, monkeypatch):
    """An interrupt gives no grace: the lingering child (answered, an hour to go) is killed at once,
    not after the grace (made 10 minutes, which no run of two tiny scenarios takes)."""
    monkeypatch.setattr(runner_module, "_child", lingering_child)
    monkeypatch.setattr(runner_module, "EXIT_GRACE_S", 600.0)
    spec = _lingering_host(lingering_options(tmp_path, SETUP, 3600, until="never"))

    def interrupt(results):
        if results[0].scenario == "cold-warm":
            raise KeyboardInterrupt
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run_all([Context(spec, "tiny")], ["cold-warm", "multi-turn"], 300, jobs=1, on_result=interrupt)
    assert time.monotonic() - started < runner_module.EXIT_GRACE_S
    assert not multiprocessing.active_children()
    with pytest.raises(ProcessLookupError):
        os.kill(int((tmp_path / "lingering-pid").read_text()), 0)


def test_no_overlap_with_several_jobs_is_refused_with_exit_2():
    done = subprocess.run([sys.executable, "-m", "kvtool", "validate", "host", "--jobs", "2", "--no-overlap"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 2 and "--no-overlap runs one scenario process at a time" in done.stderr, done.stderr


def test_no_jobs_is_one_line_and_exit_2():
    done = subprocess.run([sys.executable, "-m", "kvtool", "validate", "host", "--jobs", "0"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["kvtool: error: --jobs must be a positive integer or auto, got '0'"]


@pytest.mark.parametrize("value", ["-1", "two", ""])
def test_a_bad_jobs_value_is_refused_before_anything_runs(value):
    result = runner.invoke(app, ["validate", "host", "--jobs", value])
    assert result.exit_code == 2
    assert result.stderr == f"kvtool: error: --jobs must be a positive integer or auto, got {value!r}\n"


def test_more_jobs_than_cpus_are_lowered_with_a_warning(monkeypatch):
    monkeypatch.setattr(sys.modules["kvtool.cli.validate"], "max_jobs", lambda num_ranks: 1)
    result = runner.invoke(app, ["validate", "host", "--model", "tiny", "--scenario", "cold-warm", "--jobs", "3"])
    assert result.exit_code == 0, result.output
    assert "kvtool: warning: --jobs 3: this machine's CPUs run 1 scenario at once; running 1" in result.stderr
    auto = runner.invoke(app, ["validate", "host", "--model", "tiny", "--scenario", "cold-warm", "--jobs", "auto"])
    assert auto.exit_code == 0 and "warning" not in auto.stderr, auto.output


def test_the_cap_counts_every_rank_of_a_scenario():
    assert max_jobs(1) >= 1 and max_jobs(1000) == 1
    assert max_jobs(2) == max(1, max_jobs(1) // 2)


def test_the_gpu_cap_counts_every_process_its_overhead_and_the_largest_models_pools():
    tiny = SCENARIO_GPU_OVERHEAD_BYTES + pools_at_max_slots("tiny")
    llama = SCENARIO_GPU_OVERHEAD_BYTES + pools_at_max_slots("llama-3.1-8b")
    assert pools_at_max_slots("llama-3.1-8b") == 512 << 20          # 128 KiB a 4-token block x 4096 pages
    assert gpu_jobs_cap(["tiny"], 4, 1, 3 * tiny) == 3
    assert gpu_jobs_cap(["tiny"], 4, 1, 3 * tiny - 1) == 2
    assert gpu_jobs_cap(["tiny"], 4, 2, 4 * tiny) == 2               # a scenario of two ranks: two processes
    assert gpu_jobs_cap(["tiny", "llama-3.1-8b"], 4, 1, 3 * llama) == 3
    assert gpu_jobs_cap(["tiny"], 4, 1, 0) == 1                      # never fewer than one


def test_jobs_beyond_the_gpus_free_memory_are_lowered_said_as_a_warning_when_asked_for(monkeypatch, capsys):
    cli = importlib.import_module("kvtool.cli.validate")     # the package exports the command under that name
    per = SCENARIO_GPU_OVERHEAD_BYTES + pools_at_max_slots("tiny")
    monkeypatch.setattr(cli.torch.cuda, "mem_get_info", lambda: (5 * per, 80 << 30))
    assert cli._jobs_that_fit_the_gpu(8, ["tiny"], 4, 1, asked=True) == 5
    assert "warning: --jobs 8: the GPU's free memory holds 5 scenarios at once" in capsys.readouterr().err
    assert cli._jobs_that_fit_the_gpu(8, ["tiny"], 4, 1, asked=False) == 5
    err = capsys.readouterr().err
    assert "warning" not in err and "holds 5 scenarios" in err
    assert cli._jobs_that_fit_the_gpu(4, ["tiny"], 4, 1, asked=True) == 4 and capsys.readouterr().err == ""


def pools_at_max_slots(model: str) -> int:
    groups = plan_pool_groups(plan_layer_groups(load_model(model), 4))
    return placed_bytes(groups, [MAX_SLOTS] * len(groups))


def test_a_scenario_running_its_seeds_does_not_hold_up_the_others(tmp_path, monkeypatch):
    """With two jobs and three seeds a scenario, a scenario whose process announces each seed's start
    but answers only once the three scenarios after it have started: they start beside it (an
    announcement wakes the scheduler but answers nothing), so it answers PASS."""
    from tests.helpers.seeded_child import seeded_child
    monkeypatch.setattr(runner_module, "_child", seeded_child)
    names = ["cold-warm", "clamp", "deferral", "contract"]
    spec = _lingering_host({"folder": str(tmp_path), "hold": "cold-warm", "others": ",".join(names[1:])})
    results = run_all([Context(spec, "tiny")], names, 60, jobs=2, seeds=(0, 1, 2))
    assert [(r.scenario, r.verdict) for r in results] == [(SETUP, Verdict.PASS)] + [(n, Verdict.PASS) for n in names]
    assert [r.seed for r in results] == [None, 0, 0, 0, 0]
