"""kvtool validate: every check can fail for the right reason, correct connectors pass, exit codes,
JUnit, timeouts, and the TensorRT-LLM compatibility layer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.connector.loader import ConnectorSpec
from kvtool.connectors.host import HostConnectorScheduler, HostConnectorWorker
from kvtool.connectors.registry import load_connector
from kvtool.engine.runtimes import DEFAULT_RUNTIME
from kvtool.validate.harness import Context
from kvtool.validate.results import CHECKS, Verdict
from kvtool.validate.runner import run_all, run_isolated
from kvtool.validate.scenarios import SCENARIOS
from tests.helpers.broken_connectors import BROKEN, RUNTIME_OF

runner = CliRunner()
MODELS = ("tiny", "tiny-vswa")
WHERE = {  # scenario-specific integrity bugs must show in their scenario
    "integrity (chunked prefill)": "chunked-prefill", "integrity (VSWA, slot -1)": "vswa-live-pages",
    "integrity (deferral)": "deferral", "integrity (clamp)": "clamp", "integrity (overtaken head)": "overtaken-head",
    "integrity (local match)": "local-prefix", "integrity (moved blocks)": "moved-blocks",
    "integrity (multi-turn)": "multi-turn",
    "integrity (final-pass blocks)": "final-pass-blocks",
}


SMALL_STORE = (("capacity", "8MiB"),)
"""The broken connectors are the host connector with one bug; its default 256 MiB store is allocated
and zeroed by every engine (dozens per run of the kit), most of such a run's time. 8 MiB still holds
2730 blocks per layer group of tiny and tiny-vswa, and no engine of the kit stores more than 28:
nothing is evicted, the connector behaves as with the default (the same checks fail)."""


def validate_in_process(target: str, scenarios=None, strict: bool = False, options=(), load_timeout: float = 5.0,
                        runtime: str = DEFAULT_RUNTIME):
    spec = load_connector(target)
    return run_all([Context(spec, m, load_timeout=load_timeout, strict=strict, options=options, runtime=runtime)
                    for m in MODELS], scenarios or list(SCENARIOS), 60, isolated=False)


@pytest.mark.slow
@pytest.mark.parametrize("label", list(BROKEN))
def test_each_broken_connector_fails_exactly_its_check(label):
    scheduler, worker = BROKEN[label]
    # warm-hit's broken connector serves nothing: a miss, which only --strict makes a failure.
    # load-completes' never reports a load: each of its loads fails when the load timeout runs out,
    # whatever its length (a quarter second instead of one: about 35 s less waiting).
    results = validate_in_process(f"tests.helpers.broken_connectors:{scheduler}:{worker}", strict=label == "warm-hit",
                                  options=SMALL_STORE, load_timeout=0.25 if label == "load-completes" else 5.0,
                                  runtime=RUNTIME_OF.get(label, DEFAULT_RUNTIME))
    failed = {r.check for r in results if r.failed}
    assert failed == {label.split(" (")[0]}, [(r.scenario, r.model, r.check, r.evidence[:2]) for r in results
                                              if r.failed]
    if label in WHERE:
        assert any(r.scenario == WHERE[label] and r.failed for r in results)


def test_serving_nothing_is_a_miss_unless_strict(tmp_path):
    target = "tests.helpers.broken_connectors:NeverServes:Worker"
    results = validate_in_process(target, ["cold-warm"])
    assert {(r.model, r.verdict.value) for r in results if r.check == "warm-hit"} == {("tiny", "miss"),
                                                                                     ("tiny-vswa", "miss")}
    assert not [r for r in results if r.failed]
    one = ["--runtime", "trtllm-v2-release"]
    relaxed = runner.invoke(app, ["validate", target, "--scenario", "cold-warm", *one,
                                  "--output", str(tmp_path / "run")])
    assert relaxed.exit_code == 0, relaxed.output
    assert "6 checks under trtllm-v2-release: 4 passed, 2 missed" in relaxed.stderr
    assert json.loads((tmp_path / "run" / "results.json").read_text())["num_missed"] == 2
    strict = runner.invoke(app, ["validate", target, "--scenario", "cold-warm", *one, "--strict"])
    assert strict.exit_code == 1 and "6 checks under trtllm-v2-release: 4 passed, 2 failed" in strict.output


def test_warm_hit_counts_tokens_served_intact_not_offered():
    """A warm request whose load raised was offered tokens but served none: a miss with the reason."""
    results = validate_in_process("tests.helpers.broken_connectors:HostConnectorScheduler:LoadRaisesWorker",
                                  ["cold-warm"])
    (hit,) = [r for r in results if r.check == "warm-hit" and r.model == "tiny"]
    assert hit.verdict.value == "miss"
    assert "tokens offered, none served intact: it failed" in hit.evidence[0], hit.evidence


def test_every_check_has_a_broken_connector():
    assert {label.split(" (")[0] for label in BROKEN} == set(CHECKS)


@pytest.mark.parametrize("target", ["host", "disk", "host-async", "host-layerwise"])
def test_the_reference_connectors_pass_everything(target):
    results = validate_in_process(target)
    assert not [r for r in results if r.failed], [(r.scenario, r.model, r.check, r.evidence) for r in results
                                                  if r.failed]
    assert {r.check for r in results} >= {"registration", "integrity", "warm-hit", "holds-nothing",
                                          "survives-hook-failure", "answers-in-contract", "salt-isolation"}


def test_evidence_names_the_coordinates():
    results = validate_in_process("tests.helpers.broken_connectors:HostConnectorScheduler:WrongSlotWorker",
                                  ["cold-warm"])
    (bad,) = [r for r in results if r.check == "integrity" and r.model == "tiny"]
    assert "request 1, layer group 0, block" in bad.evidence[0] and "expected" in bad.evidence[0]


def test_cli_exit_codes_junit_and_json(tmp_path):
    junit, out = tmp_path / "v.xml", tmp_path / "v.json"
    ok = runner.invoke(app, ["validate", "host", "--scenario", "cold-warm", "--scenario", "clamp",
                             "--junit", str(junit), "--json", str(out)])
    assert ok.exit_code == 0, ok.output
    suite = ET.parse(junit).getroot()
    # every runtime: V1 refuses tiny-vswa (its registration skipped, nothing else run on it)
    assert suite.tag == "testsuites" and int(suite.get("tests")) == 26 and suite.get("failures") == "0"
    cases = suite.findall("./testsuite/testcase")
    assert {c.get("classname") for c in cases} >= {"cold-warm[tiny, trtllm-v1]", "clamp[tiny-vswa, trtllm-v2]",
                                                  "setup[tiny, trtllm-v2-release]", "setup[tiny-vswa, trtllm-v1]"}
    assert "cold-warm[tiny-vswa, trtllm-v1]" not in {c.get("classname") for c in cases}
    doc = json.loads(out.read_text())
    assert doc["passed"] is True and {r["check"] for r in doc["results"]} >= {"integrity", "warm-hit"}
    assert doc["runtimes"] == ["trtllm-v1", "trtllm-v2", "trtllm-v2-release"]
    assert {r["runtime"] for r in doc["results"]} == set(doc["runtimes"])
    bad = runner.invoke(app, ["validate", "tests.helpers.broken_connectors:NeverServes:Worker",
                              "--scenario", "cold-warm", "--junit", str(junit), "--strict"])
    assert bad.exit_code == 1 and "2 failed" in bad.stderr
    failures = ET.parse(junit).getroot().findall("./testsuite/testcase/failure")
    assert failures and "offered nothing" in failures[0].get("message")


@pytest.mark.parametrize("args, message", [
    (["no.such.module:A:B"], "cannot import no.such.module"),
    (["kvtool.connectors.host:Nope:HostConnectorWorker"], "has no class Nope"),
    (["missing/file.py:A:B"], "no file"),
    (["host", "--scenario", "nope"], "unknown scenario"),
    (["host", "--model", "llama-9"], "unknown model"),
    (["host", "--compat", "nope"], "unknown --compat 'nope'; known: trtllm, vllm"),
    (["host", "--connector-opt", "capacity=1"], "below one block"),
])
def test_bad_targets_and_options_exit_2(args, message):
    result = runner.invoke(app, ["validate", *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "Traceback" not in result.output


def test_list_names_every_scenario_and_check():
    result = runner.invoke(app, ["validate", "--list"])
    assert result.exit_code == 0
    for name in list(SCENARIOS) + list(CHECKS):
        assert name in result.stdout


def test_a_hanging_connector_is_stopped_by_the_timeout(tmp_path):
    hang = tmp_path / "hang.py"
    hang.write_text("import time\nfrom kvtool.connectors.host import HostConnectorScheduler, HostConnectorWorker\n"
                    "class Hangs(HostConnectorWorker):\n"
                    "    def start_load_kv(self, stream):\n"
                    "        if self.meta.loads:\n            time.sleep(3600)\n"
                    "        super().start_load_kv(stream)\n")
    done = subprocess.run([sys.executable, "-m", "kvtool", "validate", f"{hang}:HostConnectorScheduler:Hangs",
                           "--model", "tiny", "--scenario", "cold-warm", "--timeout", "15"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr   # the timeout also bounds the connector's construction
    assert "did not finish within 15 s" in done.stdout


def test_a_tensorrt_llm_connector_runs_unchanged_under_compat(tmp_path):
    target = f"{Path('tests/data/trtllm_style_connector.py').resolve()}:BlockFilesLeader:BlockFilesWorker"
    out = tmp_path / "v.json"
    done = subprocess.run([sys.executable, "-m", "kvtool", "validate", "--compat", "trtllm", target,
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    results = json.loads(out.read_text())["results"]
    verdicts = {(r["scenario"], r["model"], r["check"]): r for r in results}
    assert verdicts[("setup", "tiny", "registration")]["verdict"] == "pass"
    vswa = verdicts[("setup", "tiny-vswa", "registration")]
    assert vswa["verdict"] == "fail" and "this KV cache has 2 layer groups" in vswa["evidence"][0]
    assert verdicts[("cold-warm", "tiny", "integrity")]["verdict"] == "pass"
    assert verdicts[("cold-warm", "tiny", "warm-hit")]["verdict"] == "pass"
    # what the simplifications cost, found by the suite
    assert verdicts[("cache-salt", "tiny", "salt-isolation")]["verdict"] == "fail"
    assert verdicts[("deferral", "tiny", "integrity")]["verdict"] == "fail"


def test_without_compat_the_tensorrt_llm_import_fails_cleanly():
    target = "tests/data/trtllm_style_connector.py:BlockFilesLeader:BlockFilesWorker"
    result = runner.invoke(app, ["validate", target])
    assert result.exit_code == 2 and "No module named 'tensorrt_llm'" in result.stderr


def test_a_file_connector_runs_in_a_fork_server_process(tmp_path):
    """What a CUDA machine uses: the scenario's process is not a fork of this one, so the connector
    travels by its target and is imported again there."""
    source = tmp_path / "my_connector.py"
    source.write_text("from kvtool.connectors.host import HostConnectorScheduler as S, HostConnectorWorker as W\n")
    spec = load_connector(f"{source}:S:W")
    results = run_isolated("cold-warm", Context(spec, "tiny"), timeout=120, start_method="forkserver")
    assert [(r.check, r.verdict.value) for r in results] == [("integrity", "pass"), ("warm-hit", "pass")]


def test_the_squeeze_scenarios_size_themselves_from_the_layout():
    """gpt-oss-20b: two layer groups share one pool group, so a block takes two pages. The squeeze
    must still create the case it names (deferral, reserve failure, ...) and pass `host`."""
    squeezes = ["deferral", "reserve-failure", "overtaken-head", "free-before-delivery"]
    results = run_all([Context(load_connector("host"), "gpt-oss-20b")], squeezes, 60, isolated=False)
    assert not [r for r in results if r.failed], [(r.scenario, r.check, r.evidence[:2]) for r in results if r.failed]
    exercised = [e for r in results for e in r.evidence if e.startswith(("exercised: ", "not exercised: "))]
    assert len(exercised) == 4 and all(e.startswith("exercised: ") for e in exercised), exercised


class SlowStoreWorker(HostConnectorWorker):
    """A correct asynchronous connector on a slow store: every load takes 20 ms."""

    def load(self, transfers, layer_id=None):
        time.sleep(0.02)
        super().load(transfers, layer_id)


def test_a_slow_but_correct_async_load_is_not_a_false_alarm():
    spec = ConnectorSpec("slow-async", HostConnectorScheduler, SlowStoreWorker, "tests", {"mode": "async"})
    results = run_all([Context(spec, "tiny")], ["async-load"], 60, isolated=False)
    verdicts = {r.check: r.verdict.value for r in results if r.scenario == "async-load"}
    assert verdicts["load-completes"] == "pass" and verdicts["integrity"] == "pass", results


def test_a_dropped_offer_is_said_in_words():
    results = validate_in_process("tests.helpers.broken_connectors:ForgetsOnDeferral:Worker", ["deferral"])
    (integrity,) = [r for r in results if r.check == "integrity" and r.model == "tiny"]
    assert integrity.failed
    assert any(e.startswith("request 1: offer made at iteration ") and "dropped the offer" in e
               for e in integrity.evidence), integrity.evidence


HANGS = ("        import pathlib, time; marks = pathlib.Path(__file__).with_name('marks')\n"
         "        marks.write_text('started\\n'); time.sleep(60); marks.write_text('started\\nwoke\\n')\n")
_LEAVING = {  # where the connector leaves -> (code, exit code, --timeout, words the one line must hold)
    "import": ("import os\nos._exit(0)\n", "", 2, 300, "ended its process (exit code 0) while importing it"),
    "import-sys": ("import sys\nsys.exit(0)\n", "", 2, 300, "called sys.exit(0) while importing it"),
    "constructor": ("", "        import sys; sys.exit(3)\n", 2, 300,
                    "called sys.exit(3) while constructing its scheduler and worker"),
    "constructor-hangs": ("", HANGS, 2, 10, "did not finish constructing its scheduler and worker within 10 s"),
}
"""A leaving connector is named as soon as its process ends (the timeout is only a hang guard); the
hanging one must get to its constructor within the timeout, on a loaded machine too."""


@pytest.mark.parametrize("where", list(_LEAVING))
def test_a_connector_that_leaves_or_hangs_while_loading_is_exit_2_naming_where(tmp_path, where):
    module_code, constructor_code, code, timeout, words = _LEAVING[where]
    file = tmp_path / "leaving.py"
    file.write_text(module_code + "from kvtool.connectors.host import HostConnectorScheduler, HostConnectorWorker\n"
                    "class S(HostConnectorScheduler):\n    def __init__(self, llm_args):\n" + constructor_code +
                    "        super().__init__(llm_args)\n")
    result = runner.invoke(app, ["validate", f"{file}:S:HostConnectorWorker", "--timeout", str(timeout),
                                 "--scenario", "cold-warm"])
    assert result.exit_code == code, result.output
    assert words in result.output and "Traceback" not in result.output
    if where == "constructor-hangs":   # stopped, not waited for: its 60 s sleep never ended
        assert (tmp_path / "marks").read_text() == "started\n"


def test_a_hook_that_ends_the_process_fails_the_scenario(tmp_path):
    file = tmp_path / "leaving.py"
    file.write_text("import os\nfrom kvtool.connectors.host import HostConnectorScheduler, HostConnectorWorker\n"
                    "class W(HostConnectorWorker):\n    def start_load_kv(self, stream):\n        os._exit(0)\n")
    result = runner.invoke(app, ["validate", f"{file}:HostConnectorScheduler:W", "--scenario", "cold-warm",
                                 "--format", "csv"])
    assert result.exit_code == 1, result.output
    assert "the scenario's process died (exit code 0)" in result.output


class CountingGc:
    """Stands in for the gc module in `runner`: counts collections (a forked child inherits it and
    says so in a file, its only way back)."""

    def __init__(self, marker) -> None:
        self.marker = marker
        self.collected = 0

    def collect(self) -> int:
        self.collected += 1
        with open(self.marker, "a") as out:
            out.write(f"{os.getpid()}\n")
        return 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests/gpu reads the flag back in a real scenario process")
def test_a_scenario_process_asks_to_sleep_while_it_waits_for_the_gpu_and_without_one_nothing_changes(
        tmp_path, monkeypatch):
    """Forked children (no CUDA here) see the stand-in; asking here, without a GPU, sets nothing."""
    from kvtool.validate import processes, runner

    def asked() -> bool:
        (tmp_path / "asked").touch()
        return processes.sleep_while_waiting_for_the_gpu()
    monkeypatch.setattr(runner, "sleep_while_waiting_for_the_gpu", asked)
    isolated = run_isolated("cold-warm", Context(load_connector("host"), "tiny"), timeout=120)
    assert {r.verdict for r in isolated} == {Verdict.PASS}
    assert (tmp_path / "asked").exists()
    assert processes.sleep_while_waiting_for_the_gpu() is False


def test_a_scenario_run_here_collects_its_garbage_and_one_in_its_own_process_leaves_that_to_its_end(
        tmp_path, monkeypatch):
    from kvtool.validate import runner
    counting = CountingGc(tmp_path / "collected")
    monkeypatch.setattr(runner, "gc", counting)
    isolated = run_isolated("cold-warm", Context(load_connector("host"), "tiny"), timeout=120, start_method="fork")
    assert {r.verdict for r in isolated} == {Verdict.PASS}
    assert not (tmp_path / "collected").exists()      # the child ends at once: os._exit frees it all
    here = runner.run_scenario("cold-warm", Context(load_connector("host"), "tiny"))
    assert {r.verdict for r in here} == {Verdict.PASS}
    assert counting.collected == 1
