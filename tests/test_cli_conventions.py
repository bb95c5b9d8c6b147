"""What a newcomer meets on the command line: one-line errors, declared options, one output convention."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.connectors import disk
from kvtool.connectors.block_codec import HEADER
from kvtool.connectors.disk import sweep_stale_temp_files, write_block
from tests.test_connectors import requests, run

runner = CliRunner()
WORKLOAD = str(Path(__file__).resolve().parent.parent / "workloads" / "shared_prefix.jsonl")
REPO = Path(__file__).resolve().parent.parent


def kvtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The real entry point, as a shell runs it (stderr exactly as a user sees it)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "kvtool", *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env=env)


def one_error_line(stderr: str) -> str:
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtool: error: "), stderr
    return lines[0]


# ---- one line per error ---------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["bench", "--tokens-per-block", "x"], "Invalid value for '--tokens-per-block'"),
    (["inspect-layout", "--format", "xml"], "'xml' is not one of"),
    (["nosuch"], "No such command 'nosuch'"),
    (["trace", "run", WORKLOAD, "--gpu-memory", ""], "cannot read size ''"),
])
def test_usage_errors_are_one_line_and_exit_2(args, message):
    done = kvtool(*args)
    assert done.returncode == 2 and message in one_error_line(done.stderr)


def test_version():
    done = kvtool("--version")
    assert done.returncode == 0 and done.stdout.startswith("kvtool ") and done.stdout.strip() != "kvtool"


def test_help_shows_flags_defaults_and_every_builtin():
    bench_help = runner.invoke(app, ["bench", "--help"]).stdout
    assert "<bool>" not in bench_help and "--quick " in bench_help
    assert "[default: 64MiB" in bench_help.replace("\n", " ").replace("  ", " ") or "64MiB" in bench_help
    assert "tpb 4/32" in bench_help and "5 on a CPU" in bench_help
    validate_help = " ".join(runner.invoke(app, ["validate", "--help"]).stdout.split())
    assert all(name in validate_help for name in ("host-async", "host-layerwise", "disk"))


# ---- declared connector options -------------------------------------------------------------
def test_an_unknown_connector_option_names_the_known_ones(tmp_path):
    for args in (["trace", "run", WORKLOAD, "--connector", "host", "--connector-opt", "capcity=1GiB"],
                 ["validate", "host", "--connector-opt", "capcity=1GiB"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, result.output
        assert "has no option 'capcity'; its options: mode, backend, capacity" in result.stderr


def test_a_bad_choice_is_refused_before_anything_runs():
    result = runner.invoke(app, ["validate", "host", "--connector-opt", "mode=fast"])
    assert result.exit_code == 2 and "mode='fast' must be one of sync, async, layerwise" in result.stderr
    result = runner.invoke(app, ["validate", "host", "--connector-opt", "backend=warp"])
    assert result.exit_code == 2 and "no transfer backend 'warp'" in result.stderr


def test_connector_help_lists_options_with_defaults():
    result = runner.invoke(app, ["validate", "disk", "--connector-help"])
    assert result.exit_code == 0
    assert "--connector-opt dir: " in result.stdout and "[default: kvtool-disk-cache]" in result.stdout
    assert "mode (sync|async|layerwise)" in result.stdout


def test_an_undeclaring_connector_gets_its_options_with_a_warning():
    target = "tests.helpers.connectors:ScriptedScheduler:NoOpWorker"
    result = runner.invoke(app, ["trace", "run", WORKLOAD, "--connector", target, "--connector-opt", "x=1"])
    assert "declares no options (kvtool_options); passing x unchecked" in result.stderr


@pytest.mark.parametrize("connector", ["none", "host"])
def test_connector_dir_needs_the_disk_connector(connector, tmp_path):
    result = runner.invoke(app, ["trace", "run", WORKLOAD, "--connector", connector, "--connector-dir", str(tmp_path)])
    assert result.exit_code == 2 and "--connector-dir is the disk connector's folder" in result.stderr


# ---- input that used to be accepted silently ------------------------------------------------
@pytest.mark.parametrize("arrival", ["NaN", "Infinity", "-1"])
def test_an_arrival_that_is_not_a_finite_time_is_refused(arrival, tmp_path):
    workload = tmp_path / "w.jsonl"
    workload.write_text(f'{{"request_id": 1, "prompt": [1, 2, 3], "max_new_tokens": 1, "arrival": {arrival}}}\n')
    result = runner.invoke(app, ["trace", "run", str(workload)])
    assert result.exit_code == 2 and "arrival must be a finite number of seconds >= 0" in result.stderr


def _config(folder: Path, **extra) -> Path:
    folder.mkdir(parents=True)
    path = folder / "config.json"
    path.write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "hidden_size": 256, **extra}))
    return path


def test_a_config_file_model_is_named_after_its_own_keys_and_says_so(tmp_path):
    named = _config(tmp_path / "a" / "to", model_type="mistral")
    result = runner.invoke(app, ["inspect-layout", "--model", str(named), "--format", "json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["model"] == "mistral"
    assert f"kvtool: model 'mistral' (the model_type of {named})" in result.stderr
    anonymous = _config(tmp_path / "b" / "to")
    result = runner.invoke(app, ["inspect-layout", "--model", str(anonymous), "--format", "json"])
    assert json.loads(result.stdout)["model"] == str(anonymous)          # not "to"
    assert "kvtool: model" not in result.stderr                            # the name is the path: nothing to add


# ---- outputs checked before the work --------------------------------------------------------
def test_bench_refuses_a_file_as_its_output_folder_at_once(tmp_path, monkeypatch):
    """Before any of the work: the backends are not even probed."""
    import importlib
    bench_command = importlib.import_module("kvtool.cli.bench")   # the module: kvtool.cli's `bench` is the command

    def work_began():
        raise AssertionError("the bench began its work before checking its output folder")
    monkeypatch.setattr(bench_command, "available_backends", work_began)
    target = tmp_path / "taken"
    target.write_text("mine")
    result = runner.invoke(app, ["bench", "--quick", "--output", str(target)])
    assert result.exit_code == 2 and "is a file; give a folder" in result.stderr
    assert target.read_text() == "mine"


def test_validate_refuses_an_unwritable_junit_path_before_any_scenario(tmp_path):
    result = runner.invoke(app, ["validate", "host", "--junit", str(tmp_path)])     # a folder
    assert result.exit_code == 2 and "is a folder; give a file name" in result.stderr
    assert "cold-warm" not in result.stderr                                         # no scenario ran
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as a user who can write anywhere")
        result = runner.invoke(app, ["validate", "host", "--output", str(locked / "run")])
        assert result.exit_code == 2 and "cannot write to" in result.stderr
    finally:
        locked.chmod(0o700)


# ---- one output convention -------------------------------------------------------------------
def test_every_command_writes_a_run_folder_with_meta(tmp_path):
    cases = {
        "inspect-layout": (["inspect-layout", "--model", "tiny"], {"layout.json", "layout.csv"}),
        "trace": (["trace", "run", WORKLOAD], {"summary.json", "summary.csv", "requests.csv", "iterations.csv"}),
        "validate": (["validate", "host", "--scenario", "cold-warm", "--model", "tiny"],
                     {"results.json", "results.csv", "junit.xml"}),
    }
    for name, (args, files) in cases.items():
        folder = tmp_path / name
        result = runner.invoke(app, [*args, "--output", str(folder), "--format", "json"])
        assert result.exit_code == 0, (name, result.output)
        assert {p.name for p in folder.iterdir()} == files | {"meta.json"}, name
        meta = json.loads((folder / "meta.json").read_text())
        assert meta["suite"] == name and "device" in meta and "commit" in meta
        json.loads(result.stdout)                                   # --format json prints JSON only


def test_old_spellings_still_work_with_a_deprecation_line(tmp_path):
    result = runner.invoke(app, ["trace", "run", WORKLOAD, "--json", str(tmp_path / "s.json")])
    assert result.exit_code == 0 and "--json FILE is deprecated" in result.stderr
    num_requests = len(Path(WORKLOAD).read_text().splitlines())
    assert json.loads((tmp_path / "s.json").read_text())["num_requests"] == num_requests
    result = runner.invoke(app, ["inspect-layout", "--model", "tiny", "--format", "csv",
                                 "--output", str(tmp_path / "layout.csv")])
    assert result.exit_code == 0 and "--output FILE is deprecated" in result.stderr
    assert (tmp_path / "layout.csv").read_text().startswith("layer_group")


# ---- bench output that teaches ----------------------------------------------------------------
def test_bench_on_a_cpu_explains_itself(tmp_path_factory):
    # a short folder: rich wraps `results in FOLDER` at 80 columns without a terminal, and a test's
    # own tmp_path under pytest-xdist (.../popen-gw0/test_bench_on_a_cpu_explains_i0) is long enough
    tmp_path = tmp_path_factory.mktemp("b")
    done = kvtool("bench", "--quick", "--direction", "save", "--granularity", "slot", "--output", "run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "ratio: GB/s / peak GB/s" in done.stdout and "±peak" in done.stdout
    assert "no CUDA GPU here" in done.stdout and "not run here: kernel, staged" in done.stdout
    assert f"results in {tmp_path / 'run'}" in done.stderr            # absolute
    assert "bench 1/1: torch save llama-3.1-8b/4 slot:" in done.stderr  # no terminal: a line per case


# ---- the disk connector ------------------------------------------------------------------------
def test_a_corrupt_size_field_says_what_it_records(tmp_path):
    path, key = tmp_path / "b.kvb", b"\x03" * 32
    write_block(path, key, 0, bytes(64))
    data = bytearray(path.read_bytes())
    header_size_at = HEADER.size - 32 - 8
    data[header_size_at:header_size_at + 8] = (65).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(disk.CorruptBlock, match="header records a 65-byte payload; this layout's pages hold 64"):
        disk.read_block(path, key, 0, 64)


def test_stale_temp_files_are_swept_and_young_ones_kept(tmp_path):
    (tmp_path / "ab").mkdir()
    stale, young = tmp_path / "ab" / ".x.kvb.1.tmp", tmp_path / "ab" / ".y.kvb.2.tmp"
    stale.write_bytes(b"partial")
    young.write_bytes(b"in flight")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    assert sweep_stale_temp_files(tmp_path) == 1
    assert not stale.exists() and young.exists()


def test_a_chain_with_several_corrupt_blocks_heals_in_one_run(tmp_path):
    first = run("disk", options={"dir": str(tmp_path)})
    root = first.connector.scheduler.root
    files = sorted(root.glob("*/*.kvb"), key=lambda p: p.stat().st_mtime_ns)
    for victim in files[2:5]:                                  # three corrupt blocks in the shared prefix
        victim.write_bytes(victim.read_bytes()[:-1] + b"\x00")
    with pytest.warns(RuntimeWarning, match="corrupt block"):
        run("disk", options={"dir": str(tmp_path)}, reqs=requests()[:1])     # one request: one lookup chain
    healed = run("disk", options={"dir": str(tmp_path)})
    assert healed.connector.scheduler.num_corrupt == 0 and healed.integrity_errors == 0
    assert healed.states[0].num_external == 40                               # the whole shared prefix again


def test_the_default_disk_folder_is_ignored_by_git():
    assert "kvtool-disk-cache/" in (REPO / ".gitignore").read_text().splitlines()


def test_an_error_after_the_progress_bar_is_still_one_line():
    done = kvtool("trace", "run", WORKLOAD, "--num-slots", "2")
    assert done.returncode == 2 and "the KV cache is too small" in one_error_line(done.stderr)


def test_a_shard_folder_replaced_by_a_file_is_a_miss_with_a_warning(tmp_path):
    first = run("disk", options={"dir": str(tmp_path)})
    shards = sorted(p for p in first.connector.scheduler.root.iterdir() if p.is_dir())
    victim = shards[0]
    for f in victim.iterdir():
        f.unlink()
    victim.rmdir()
    victim.write_text("not a folder")
    with pytest.warns(RuntimeWarning, match="is not a folder"):
        again = run("disk", options={"dir": str(tmp_path)})
    assert again.integrity_errors == 0 and all(s.failure is None for s in again.states.values())
