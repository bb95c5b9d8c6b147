"""A connector author's first hour on the command line: every surprise of the issue of that name,
each as a test that fails without its fix."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.cli.common import suggest
from kvtool.report.bench_report import write_run
from kvtool.report.run_folder import prepare_run_folder, settle_run_folders, write_meta
from kvtool.units import parse_size

runner = CliRunner()
REPO = Path(__file__).resolve().parent.parent
EXAMPLE = str(REPO / "examples" / "dict_connector.py")
EXAMPLE_TARGET = f"{EXAMPLE}:DictConnectorScheduler:DictConnectorWorker"
SHIPPED = str(REPO / "workloads" / "shared_prefix.jsonl")


def small_workload(tmp_path: Path, lines: list[dict] | None = None) -> Path:
    path = tmp_path / "w.jsonl"
    shared = list(range(500, 564))
    lines = lines or [{"request_id": i, "prompt": shared + [i] * (5 + i), "max_new_tokens": 3, "arrival": i * 0.05}
                      for i in range(4)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def mooncake_trace(path: Path, lengths: list[int], output_length: int = 10) -> Path:
    records = []
    for i, length in enumerate(lengths):
        records.append({"timestamp": i * 10, "input_length": length, "output_length": output_length,
                        "hash_ids": list(range(i * 10_000, i * 10_000 + -(-length // 512)))})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# ---- 1. trace sweep --connector / --compat ------------------------------------------------------
def test_a_sweep_runs_a_connector_of_your_own_over_tokens_per_block(tmp_path):
    result = runner.invoke(app, ["trace", "sweep", str(small_workload(tmp_path)), "--connector", EXAMPLE_TARGET,
                                 "--tokens-per-block", "16,32", "--no-local-reuse", "--jobs", "1",
                                 "--format", "json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [(r["capacity_tokens"], r["tokens_per_block"]) for r in rows] == [(None, 16), (None, 32)]
    assert all(r["tier"] == EXAMPLE_TARGET and r["connector_hit_tokens"] > 0 and not r["failed_checks"]
               for r in rows)


def test_a_sweep_takes_compat_as_trace_run_does(tmp_path):
    # in a process of its own: --compat puts TensorRT-LLM's modules into sys.modules for good
    done = subprocess.run([sys.executable, "-m", "kvtool", "trace", "sweep", str(small_workload(tmp_path)),
                           "--connector", EXAMPLE_TARGET, "--compat", "trtllm", "--tokens-per-block", "16",
                           "--no-local-reuse", "--format", "json"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)[0]["connector_hit_tokens"] > 0


def test_a_sweep_says_it_cannot_size_a_connector_of_your_own(tmp_path):
    result = runner.invoke(app, ["trace", "sweep", str(small_workload(tmp_path)), "--connector", EXAMPLE_TARGET,
                                 "--capacity", "1e5"])
    assert result.exit_code == 2 and "keeps its own size" in result.stderr and "drop --capacity" in result.stderr
    text = " ".join(runner.invoke(app, ["trace", "sweep", "--help"]).stdout.split())
    assert "only --tokens-per-block is swept" in text and "--compat" in text


def test_a_sized_connector_named_on_a_sweep_is_swept_over_capacity(tmp_path):
    result = runner.invoke(app, ["trace", "sweep", str(small_workload(tmp_path)), "--connector", "host-async",
                                 "--capacity", "32,1e6", "--tokens-per-block", "16", "--no-local-reuse",
                                 "--jobs", "1", "--format", "json"])
    assert result.exit_code == 0, result.output
    small, large = json.loads(result.stdout)
    assert (small["tier"], small["capacity_tokens"], large["capacity_tokens"]) == ("host-async", 32, 10**6)
    assert small["connector_hit_tokens"] < large["connector_hit_tokens"]


def test_a_disk_sweep_gives_each_point_its_own_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["trace", "sweep", str(small_workload(tmp_path)), "--connector", "disk",
                                 "--tokens-per-block", "16,32", "--no-local-reuse", "--jobs", "1",
                                 "--format", "json"])
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "kvtool-disk-cache").exists()
    first, second = json.loads(result.stdout)
    assert first["connector_hit_tokens"] == 3 * 64 and second["connector_hit_tokens"] == 3 * 64   # nothing carried over


# ---- 2. --connector-help on every replay command --------------------------------------------------
@pytest.mark.parametrize("command", [["trace", "run"], ["trace", "sweep"]])
def test_connector_help_on_the_replay_commands_needs_no_workload(command):
    result = runner.invoke(app, [*command, "--connector-help", "--connector", "host"])
    assert result.exit_code == 0, result.output
    assert "connector host" in result.stdout and "--connector-opt capacity: " in result.stdout
    result = runner.invoke(app, [*command, "--connector", EXAMPLE_TARGET, "--connector-help"])
    assert result.exit_code == 0 and "declares no options" in result.stdout


def test_connector_help_on_a_sweep_without_a_connector_names_the_sweeps_own_tier(tmp_path):
    result = runner.invoke(app, ["trace", "sweep", str(small_workload(tmp_path)), "--connector-help"])
    assert result.exit_code == 0 and "connector host" in result.stdout          # bytes fidelity's tier



def test_connector_help_on_the_store_bench_lists_a_file_connectors_options(tmp_path):
    connector = tmp_path / "opts_connector.py"
    connector.write_text(f"import sys\nsys.path.insert(0, {str(REPO / 'examples')!r})\n"
                         "from dict_connector import DictConnectorScheduler, DictConnectorWorker\n"
                         "from kvtool.connector.options import ConnectorOption\n"
                         "class Sched(DictConnectorScheduler):\n"
                         "    kvtool_options = (ConnectorOption('depth', 'how deep', default='3'),)\n")
    out = tmp_path / "run"
    result = runner.invoke(app, ["bench", "--suite", "store", "--connector", f"{connector}:Sched:DictConnectorWorker",
                                 "--connector-help", "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[1:] == ["  --connector-opt depth: how deep [default: 3]"]
    assert not out.exists()                                     # printed, nothing measured
    result = runner.invoke(app, ["bench", "--suite", "store", "--connector", EXAMPLE_TARGET, "--connector-help"])
    assert result.exit_code == 0 and "declares no options" in result.stdout

# ---- 3. did you mean ---------------------------------------------------------------------------------
def test_a_mistyped_builtin_connector_gets_a_suggestion():
    result = runner.invoke(app, ["trace", "run", SHIPPED, "--connector", "hots"])
    assert result.exit_code == 2 and "did you mean 'host'?" in result.stderr


def test_a_mistyped_class_names_your_file_and_the_closest_class():
    result = runner.invoke(app, ["trace", "run", SHIPPED, "--connector",
                                 f"{EXAMPLE}:DictSchedular:DictConnectorWorker"])
    assert result.exit_code == 2, result.output
    assert f"{EXAMPLE} has no class DictSchedular (did you mean 'DictConnectorScheduler'?)" in result.stderr
    assert "kvtool_connector_" not in result.stderr


def test_a_module_name_typed_beside_its_file_suggests_the_file(tmp_path, monkeypatch):
    (tmp_path / "first_hour_conn.py").write_text((REPO / "examples" / "dict_connector.py").read_text())
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["trace", "run", SHIPPED, "--connector", "first_hour_conn:DictConnectorScheduler:W"])
    assert result.exit_code == 2, result.output
    assert "did you mean first_hour_conn.py:DictConnectorScheduler:W" in result.stderr


def test_a_target_without_its_worker_says_so():
    result = runner.invoke(app, ["trace", "run", SHIPPED, "--connector", f"{EXAMPLE}:DictConnectorScheduler"])
    assert result.exit_code == 2
    assert "the worker class is missing" in result.stderr and "FILE.py:SCHED:WORKER" in result.stderr


def test_suggest_names_the_closest_scenario():
    from kvtool.validate.scenarios import SCENARIOS
    assert suggest("cold-wram", SCENARIOS) == " (did you mean 'cold-warm'?)"
    assert suggest("zzzzzz", SCENARIOS) == ""


def test_a_mistyped_scenario_gets_a_suggestion():
    result = runner.invoke(app, ["validate", "host", "--scenario", "cold-wram"])
    assert result.exit_code == 2 and "did you mean 'cold-warm'?" in result.stderr


# ---- 4. a bad --format said as every bad choice is ---------------------------------------------------
@pytest.mark.parametrize("command", [["inspect-layout"], ["trace", "run", SHIPPED], ["bench"]])
def test_a_bad_format_is_said_without_the_validators_words(command):
    result = runner.invoke(app, [*command, "--format", "yaml"])
    assert result.exit_code == 2
    assert "Invalid value for '--format': 'yaml' is not one of 'table', 'json', 'csv'." in result.stderr
    assert "Value error" not in result.stderr


# ---- 5. a reused --output folder holds one run ------------------------------------------------------
def test_a_reused_output_folder_holds_only_the_latest_run(tmp_path):
    folder = tmp_path / "run"
    assert runner.invoke(app, ["trace", "run", SHIPPED, "--output", str(folder), "--format", "json"]).exit_code == 0
    assert json.loads((folder / "meta.json").read_text())["files"] == [
        "iterations.csv", "requests.csv", "summary.csv", "summary.json"]
    (folder / "notes.txt").write_text("mine")
    result = runner.invoke(app, ["trace", "run", SHIPPED, "--output", str(folder), "--format", "json",
                                 "--connector", "host", "--timeline", str(tmp_path / "t.json")])
    assert result.exit_code == 0 and "held an earlier run: replacing its 5 files" in result.stderr
    assert {p.name for p in folder.iterdir()} == {"iterations.csv", "requests.csv", "summary.csv", "summary.json",
                                                  "meta.json", "notes.txt"}


def test_another_commands_run_folder_is_refused_and_kept(tmp_path):
    """A run of another command would delete results the user still reads (a bench run a replay's
    --bandwidth-from is about to take its rate from)."""
    folder = tmp_path / "run"
    assert runner.invoke(app, ["trace", "run", SHIPPED, "--output", str(folder), "--format", "json"]).exit_code == 0
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    for command in (["inspect-layout", "--model", "tiny"], ["bench", "--suite", "manager"],
                    ["validate", "host", "--scenario", "cold-warm"]):
        result = runner.invoke(app, [*command, "--output", str(folder)])
        assert result.exit_code == 2
        assert result.stderr.splitlines() == [f"kvtool: error: --output {folder} holds a kvtool trace run; a "
                                              f"{command[0]} run would replace it: give another folder (or remove "
                                              "that one)"]
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_a_bench_folder_lists_its_files_and_is_cleared_the_same_way(tmp_path):
    folder = prepare_run_folder(tmp_path / "bench")
    write_run(folder, [{"operation": "ask", "us_per_block": 1.0}], {"compute": [{"x": 1}]}, "manager")
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["files"] == ["compute.csv", "results.csv", "results.json"]
    prepare_run_folder(folder)
    settle_run_folders(failed=False)
    assert list(folder.iterdir()) == []


def test_a_run_that_fails_before_its_results_puts_the_earlier_run_back(tmp_path):
    """Nothing already saved is lost to a failure: the earlier run is set aside, not deleted."""
    folder = prepare_run_folder(tmp_path / "bench")
    write_run(folder, [{"operation": "ask", "us_per_block": 1.0}], {}, "manager")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    prepare_run_folder(folder)
    assert [p.name for p in folder.iterdir()] == [".kvtool-earlier-run"]
    (folder / "results.csv").write_text("partial")              # the failed run's own, replaced
    settle_run_folders(failed=True)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    result = runner.invoke(app, ["bench", "--quick", "--batch-bytes", "1000TiB", "--output", str(folder)])
    assert result.exit_code == 2 and {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_a_runs_own_subfolder_is_listed_and_cleared_and_the_users_are_kept(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    folder = prepare_run_folder(tmp_path)
    (folder / "tracebacks").mkdir()
    (folder / "tracebacks" / "cold-warm-tiny.txt").write_text("Traceback ...")
    (folder / "results.json").write_text("{}")
    write_meta(folder, "validate")
    assert json.loads((folder / "meta.json").read_text())["files"] == ["results.json", "tracebacks/cold-warm-tiny.txt"]
    prepare_run_folder(folder)
    settle_run_folders(failed=False)
    assert [p.relative_to(tmp_path).as_posix() for p in sorted(tmp_path.rglob("*"))] == ["mine", "mine/notes.txt"]


def test_a_folder_kvtool_did_not_write_is_left_alone(tmp_path):
    (tmp_path / "meta.json").write_text('{"mine": true}')
    (tmp_path / "summary.json").write_text("{}")
    prepare_run_folder(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"meta.json", "summary.json"}


# ---- 6. where the disk connector writes -----------------------------------------------------------
def test_the_disk_connector_says_where_it_writes_by_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    workload = str(small_workload(tmp_path))
    result = runner.invoke(app, ["trace", "run", workload, "--connector", "disk", "--format", "json"])
    assert result.exit_code == 0, result.output
    assert f"connector disk writes to {tmp_path.resolve() / 'kvtool-disk-cache'}" in result.stderr
    result = runner.invoke(app, ["trace", "run", workload, "--connector", "disk", "--connector-dir",
                                 str(tmp_path / "mine"), "--format", "json"])
    assert result.exit_code == 0 and "writes to" not in result.stderr


# ---- 7. kvtool --help lists every command in a whole sentence -------------------------------------
@pytest.mark.parametrize("group", [[], ["trace"]])
def test_every_command_is_described_in_full_in_the_list(group):
    text = runner.invoke(app, [*group, "--help"]).stdout
    listed = text.split("Commands:")[1].strip().splitlines()
    assert len(listed) >= 4
    for line in listed:
        assert not line.rstrip().endswith("..."), line


# ---- 8. trace run's tables say what they count ------------------------------------------------------
def test_trace_run_labels_its_counts_cost_model_and_ttft(tmp_path, monkeypatch):
    import kvtool.trace.report as trace_report
    legends = []
    monkeypatch.setattr(trace_report, "plot_ttft_cdf", lambda path, runs: legends.extend(runs))
    result = runner.invoke(app, ["trace", "run", str(small_workload(tmp_path)), "--connector", "host",
                                 "--cost-model", "--output", str(tmp_path / "run")], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "computed_tokens (prefill + decode)" in out and "computed (prompt only)" in out
    assert "cost model: 1e+06 active parameters, 4 layers" in out and "{'" not in out
    assert "│ connector host " in out and "this run" not in out
    assert legends == ["connector host"]


# ---- 9. a workload too large for the cache: said before the replay ---------------------------------
def test_a_request_the_cache_cannot_hold_is_refused_before_the_replay_with_the_size_that_works(tmp_path,
                                                                                               monkeypatch):
    import kvtool.cli.trace as trace
    monkeypatch.setattr(trace, "run_trace", lambda *a, **k: pytest.fail("the replay started"))
    path = mooncake_trace(tmp_path / "m.jsonl", [2000] * 11 + [1_000_000] + [2000] * 5)
    result = runner.invoke(app, ["trace", "run", str(path)])
    assert result.exit_code == 2, result.output
    message = result.stderr       # the pool llama-3.1-8b leaves on an H200: 912,608 tokens
    assert "request 11 (1000000 prompt + 10 new tokens) needs 31251 pages in pool group 0, which has 28519" in message
    assert f"{path} line 12" in message and "--num-slots 31251 or --gpu-memory " in message
    assert "--batch-bytes" not in message


def test_the_sizes_it_suggests_are_the_smallest_that_work(tmp_path):
    workload = str(small_workload(tmp_path))
    result = runner.invoke(app, ["trace", "run", workload, "--num-slots", "2"])
    slots, memory = re.search(r"--num-slots (\d+) or --gpu-memory (\S+)$", result.stderr.strip()).groups()
    for args, code in ((["--num-slots", slots], 0), (["--num-slots", str(int(slots) - 1)], 2),
                       (["--gpu-memory", memory], 0), (["--gpu-memory", str(int(parse_size(memory) * 0.99))], 2)):
        assert runner.invoke(app, ["trace", "run", workload, *args, "--format", "json"]).exit_code == code, args


def test_a_sweep_refuses_a_cache_too_small_before_any_replay(tmp_path):
    result = runner.invoke(app, ["trace", "sweep", str(small_workload(tmp_path)), "--num-slots", "2",
                                 "--capacity", "1e6"])
    assert result.exit_code == 2 and "the KV cache is too small" in result.stderr and "--num-slots 3 " in result.stderr


def test_pools_larger_than_the_machine_name_only_this_commands_options():
    result = runner.invoke(app, ["trace", "run", SHIPPED, "--gpu-memory", "1000000TiB"])
    assert result.exit_code == 2 and "lower --gpu-memory or --num-slots" in result.stderr
    assert "--batch-bytes" not in result.stderr


@pytest.mark.parametrize("command, reason", [
    (["trace", "run"], "32: TensorRT-LLM's default"),
    (["inspect-layout"], "32: TensorRT-LLM's default"),
    (["validate"], "so that every scenario spans many blocks"),
    (["trace", "generate"], "not a run folder"),
])
def test_defaults_that_differ_between_commands_say_why_in_help(command, reason):
    result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0
    assert reason in " ".join(result.output.split())


# ---- 10. the store bench of your connector feeds the replay's cost model ---------------------------
def test_your_connectors_bench_feeds_trace_run_bandwidth_from(tmp_path):
    """`--bandwidth-from` takes your connector's load rate from a store run, not the reference
    connector's beside it (the faster of the two, on a CPU, is either)."""
    bench = tmp_path / "bench"
    done = runner.invoke(app, ["bench", "--suite", "store", "--model", "tiny", "--quick", "--connector",
                               EXAMPLE_TARGET, "--output", str(bench)])
    assert done.exit_code == 0, done.output
    rows = json.loads((bench / "results.json").read_text())["rows"]
    (mine,) = [r["gbps"] for r in rows if r["direction"] == "load" and "DictConnectorWorker" in r["connector"]]
    result = runner.invoke(app, ["trace", "run", str(small_workload(tmp_path)), "--connector", EXAMPLE_TARGET,
                                 "--model", "tiny", "--tokens-per-block", "16", "--bandwidth-from",
                                 str(bench), "--output", str(tmp_path / "run")], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert f"connector loads at {mine:g} GB/s" in result.stdout        # the cost model is on: the rate is used
    assert result.stderr.splitlines()[0] == (f"kvtool: load rate {mine:g} GB/s from {bench} (dict_connector.py:"
                                             "DictConnectorScheduler:DictConnectorWorker, tiny, 16 tokens per block)")
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["cost_model"]["load_gbps"] == mine
    assert meta["load_gbps_from"] == {"folder": str(bench), "source": "dict_connector.py:DictConnectorScheduler:"
                                      "DictConnectorWorker", "model": "tiny", "tokens_per_block": 16, "gbps": mine}


def test_bandwidth_from_says_when_its_row_is_not_the_replays(tmp_path):
    rows = [{"backend": "staged", "direction": "load", "model": "llama-3.1-8b", "tokens_per_block": 16, "gbps": 40.0}]
    (tmp_path / "results.json").write_text(json.dumps({"rows": rows}))
    result = runner.invoke(app, ["trace", "run", str(small_workload(tmp_path)), "--connector", "host", "--model",
                                 "tiny", "--bandwidth-from", str(tmp_path)], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[0] == (
        f"kvtool: load rate 40 GB/s from {tmp_path} (staged, llama-3.1-8b, 16 tokens per block): 16 tokens per "
        "block, not this replay's 32 (the closest the run has); model llama-3.1-8b, not this replay's tiny (the run "
        "has no tiny row)")


def test_bandwidth_from_cannot_go_with_no_cost_model(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps({"rows": []}))
    result = runner.invoke(app, ["trace", "run", str(small_workload(tmp_path)), "--bandwidth-from", str(tmp_path),
                                 "--no-cost-model"])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == ["kvtool: error: --bandwidth-from sets the cost model's load rate: it "
                                          "cannot go with --no-cost-model"]


def test_bandwidth_from_skips_the_reference_rows(tmp_path):
    from kvtool.report.bench_report import bench_rate
    rows = [{"connector": "mine.py:S:W", "direction": "load", "model": "tiny", "tokens_per_block": 16, "gbps": 1.5},
            {"connector": "host (kvtool reference, backend torch)", "direction": "load", "model": "tiny",
             "tokens_per_block": 16, "gbps": 9.0}]
    (tmp_path / "results.json").write_text(json.dumps({"rows": rows}))
    assert bench_rate(tmp_path, "load", 16, "tiny").gbps == 1.5
    assert bench_rate(tmp_path, "load", 32, "tiny").gbps == 1.5


# ---- 11. bench: a connector named without --suite is the store suite; strays are refused -----------
def test_naming_a_connector_on_bench_measures_that_connector(tmp_path):
    result = runner.invoke(app, ["bench", "--connector", EXAMPLE_TARGET, "--model", "tiny", "--quick",
                                 "--format", "json", "--output", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "run" / "results.json").read_text())["rows"]
    assert {r["connector"] for r in rows} == {"dict_connector.py:DictConnectorScheduler:DictConnectorWorker",
                                              "host (kvtool reference, backend torch)"}
    assert json.loads((tmp_path / "run" / "meta.json").read_text())["suite"] == "store"


@pytest.mark.parametrize("args, message", [
    (["--suite", "manager", "--connector", "host"],
     "--connector applies to --suite store (a connector's own paths), not to --suite manager"),
    (["--suite", "transfer", "--compat", "trtllm", "--device", "cpu"],
     "--compat, --device apply to --suite store (a connector's own paths), not to --suite transfer"),
    (["--connector", "host", "--backend", "kernel"], "--backend applies to --suite transfer, not to --suite store"),
    (["--suite", "store", "--direction", "save"], "--direction applies to --suite transfer, not to --suite store"),
])
def test_an_option_the_chosen_suite_would_ignore_is_refused(args, message, tmp_path):
    result = runner.invoke(app, ["bench", *args, "--output", str(tmp_path / "run")])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [f"kvtool: error: {message}"]
    assert not (tmp_path / "run").exists()


# ---- 12. a bytes-fidelity replay whose decode steps will take long says so first -------------------
def test_a_long_decode_check_is_announced_with_its_size_and_the_ways_out(tmp_path):
    from kvtool.trace.setup import ReplayOptions, build_replay, decode_check_note
    long = small_workload(tmp_path, [{"request_id": i, "prompt": [7] * 20_000, "max_new_tokens": 2_000}
                                     for i in range(2)])
    replay = build_replay(ReplayOptions(long, model="tiny", connector="host", fidelity="bytes"))
    # 2 requests x 2000 steps x (20000 + 1000) positions, 512 bytes a position on tiny
    assert decode_check_note(replay) == (
        "bytes fidelity checks every KV byte a pass reads: this workload's decode steps read 8.4e+07 positions "
        "(40.05 GiB), about 4 minutes at the 175 MB/s a 2-core machine checks; --prefill-only leaves decode out, "
        "--fidelity blocks moves no bytes")
    assert decode_check_note(build_replay(ReplayOptions(long, model="tiny", fidelity="blocks"))) is None
    assert decode_check_note(build_replay(ReplayOptions(long, model="tiny", prefill_only=True))) is None
    assert decode_check_note(build_replay(ReplayOptions(Path(SHIPPED), model="tiny"))) is None


# ---- 13. a sweep's host tier larger than the machine: said before any replay ----------------------
def _at_most_one_gib(monkeypatch):
    import importlib
    trace_sweep = importlib.import_module("kvtool.cli.trace_sweep")    # the package's name is the command

    def memory_shortfall(num_bytes, device):
        return f"{num_bytes} bytes needed, more than this machine's memory (1 GiB)" if num_bytes > 1 << 30 else None
    monkeypatch.setattr(trace_sweep, "memory_shortfall", memory_shortfall)
    return trace_sweep


def test_a_sweep_capacity_whose_host_tier_cannot_fit_is_refused_naming_the_ones_that_do(tmp_path, monkeypatch):
    _at_most_one_gib(monkeypatch)
    result = runner.invoke(app, ["trace", "sweep", str(small_workload(tmp_path)), "--model", "tiny",
                                 "--capacity", "1e5,1e7", "--jobs", "1"])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        "kvtool: error: the host tier at 1e7 tokens does not fit: 5120000000 bytes needed, more than this machine's "
        "memory (1 GiB): give --capacity up to 1e5, or sweep --fidelity blocks (the index tier, no bytes)"]


def test_default_capacities_that_cannot_fit_are_left_out_and_said(tmp_path, monkeypatch):
    sweep = _at_most_one_gib(monkeypatch)
    monkeypatch.setattr(sweep, "DEFAULT_CAPACITIES", "1e4,1e7")
    result = runner.invoke(app, ["trace", "sweep", str(small_workload(tmp_path)), "--model", "tiny", "--jobs", "1",
                                 "--format", "json"])
    assert result.exit_code == 0, result.output
    assert [r["capacity_tokens"] for r in json.loads(result.stdout)] == [10_000]
    assert result.stderr.splitlines() == ["kvtool: the default capacity 1e7 is left out at 32 tokens per block: the "
                                          "host tier would not fit this machine's memory (--capacity chooses)"]


def test_fewer_sweep_replays_run_at_once_when_their_host_tiers_would_not_fit_together(capsys):
    import importlib
    import os

    from kvtool.trace.setup import ReplayOptions
    sweep = importlib.import_module("kvtool.cli.trace_sweep")
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    tiers = [ReplayOptions(Path("w"), connector="host", connector_opt=(f"capacity={int(memory * 0.4)}",))] * 4
    assert sweep._jobs_that_fit(tiers, 4) == 2
    assert "2 replays at once instead of 4" in capsys.readouterr().err
    assert sweep._jobs_that_fit(tiers[:1], 4) == 4                        # one point: nothing to lower
    assert sweep._jobs_that_fit([ReplayOptions(Path("w"), connector="index")] * 4, 4) == 4
