"""validate on a CUDA machine: scenario processes that can use CUDA after the parent did, and the whole
kit on device pages. Skipped without a GPU."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtool.connector.loader import ConnectorSpec
from kvtool.connectors.host import HostConnectorScheduler
from kvtool.validate.harness import Context
from kvtool.validate.results import Verdict
from kvtool.validate.runner import run_isolated
from tests.helpers.context_waits import RECORD_OPTION, RecordsHowItWaits

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]


SMALL_RUNS = {
    "after-parent-cuda": ("host", "--model", "tiny", "--device", "cpu", "--scenario", "cold-warm"),
    "compat": ("--compat", "trtllm",
               f"{REPO / 'tests/data/trtllm_style_connector.py'}:BlockFilesLeader:BlockFilesWorker",
               "--model", "tiny", "--scenario", "cold-warm"),
    "exits-at-import": ("{folder}/leaving.py:S:W",),
}
"""The small validate runs the tests below judge, each in its own folder. Each spends ~10 s starting
Python, torch, the fork server and CUDA, so the fixture starts them all at once."""
SMALL_RUNS_TOGETHER = pytest.mark.xdist_group("small-validate-runs")
"""The tests that judge them, on one pytest-xdist worker: the runs are made once, not once per worker."""


@pytest.fixture(scope="module")
def small_runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    started: dict[str, tuple[list[str], Path, subprocess.Popen]] = {}
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: _kill_groups([process for _, _, process in started.values()]))
        for name, args in SMALL_RUNS.items():
            folder = tmp_path_factory.mktemp(name)
            (folder / "leaving.py").write_text("import os\nos._exit(0)\n")
            command = _command([a.format(folder=folder) for a in args])
            with open(folder / "stdout", "w") as out, open(folder / "stderr", "w") as err:   # no pipe to fill
                started[name] = (command, folder, subprocess.Popen(command, stdout=out, stderr=err, cwd=folder,
                                                                   env=_env(), start_new_session=True))
        return {name: subprocess.CompletedProcess(command, process.wait(timeout=900),
                                                  (folder / "stdout").read_text(), (folder / "stderr").read_text())
                for name, (command, folder, process) in started.items()}


def _kill_groups(processes: list[subprocess.Popen]) -> None:
    """Kill what is left of each validate run, the run and its scenario processes (each run leads
    a session of its own), even when the run itself has ended (its scenario processes may not)."""
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _command(args) -> list[str]:
    return [sys.executable, "-m", "kvtool", "validate", *args]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


@SMALL_RUNS_TOGETHER
def test_scenarios_run_after_the_parent_initialised_cuda(small_runs):
    """The parent builds the connector (pinned buffers: CUDA is initialised) before any scenario."""
    done = small_runs["after-parent-cuda"]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "initialization error" not in done.stdout + done.stderr


WHOLE_KIT = ("host", "host-async", "host-layerwise", "disk")
JOBS = os.environ.get("KVTOOL_WHOLE_KIT_JOBS", "4")
"""Scenarios at once per validation: the four validations keep 16 scenario processes running, one per
core of the H200 machine (each lowers its --jobs to the CPUs it sees, but knows nothing of the others).
The variable is for measuring another count on the GPU machine (`gpu-sessions/gpu-session tests-twice`)."""


@pytest.mark.slow
def test_the_whole_kit_passes_on_device_pages(tmp_path):
    """Every built-in host-memory connector, each in its own process, all at once, each running
    `JOBS` scenarios at once (they share the GPU, which only adds contention). One after another the
    four validations took four times as long; at once, with one scenario at a time each, 84 s on
    the H200."""
    runs: dict[str, subprocess.Popen] = {}
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: _kill_groups(list(runs.values())))
        for connector in WHOLE_KIT:
            folder = tmp_path / connector
            folder.mkdir()
            runs[connector] = subprocess.Popen(_command([connector, "--device", "cuda", "--jobs", JOBS,
                                                        "--output", str(folder / "run")]),
                                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=folder,
                                               env=_env(), start_new_session=True)
        outcomes = {name: (run.communicate(timeout=900), run.returncode) for name, run in runs.items()}
    failed = {name: out[-4000:] + err[-2000:] for name, ((out, err), code) in outcomes.items() if code != 0}
    assert not failed, "\n\n".join(f"--- {name} ---\n{text}" for name, text in failed.items())
    for connector in WHOLE_KIT:
        assert (tmp_path / connector / "run" / "results.json").exists()


@SMALL_RUNS_TOGETHER
def test_compat_modules_reach_fork_server_processes(small_runs):
    """A fork server's children import nothing from the parent: --compat must be installed there too."""
    done = small_runs["compat"]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


@SMALL_RUNS_TOGETHER
def test_a_connector_that_exits_at_import_is_exit_2_under_the_fork_server(small_runs):
    done = small_runs["exits-at-import"]
    assert done.returncode == 2 and "ended its process (exit code 0) while importing it" in done.stderr


def test_a_scenario_process_sleeps_while_it_waits_for_the_gpu(tmp_path):
    """CUDA spins a core for each wait by default; a scenario process (up to a core's worth share one
    GPU) blocks instead, set before its context exists."""
    record = tmp_path / "waits"
    spec = ConnectorSpec("records", HostConnectorScheduler, RecordsHowItWaits, "tests.helpers.context_waits",
                         {RECORD_OPTION: str(record)})
    results = run_isolated("cold-warm", Context(spec, "tiny", device="cuda"), timeout=120, start_method="forkserver")
    assert {r.verdict for r in results} == {Verdict.PASS}
    assert record.read_text() == "blocking"
