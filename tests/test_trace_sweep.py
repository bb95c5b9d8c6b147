"""`kvtool trace sweep`: one replay per point, in processes, and the files it writes."""

import json

import pandas as pd
import pytest
from helpers.traces import random_mooncake_trace, reusable_tokens
from typer.testing import CliRunner

from kvtool.cli import app

runner = CliRunner()


def test_a_sweep_in_processes_rises_to_the_bound_and_writes_its_files(tmp_path):
    path = tmp_path / "m.jsonl"
    records = random_mooncake_trace(path, 60, 64, seed=7)
    out = tmp_path / "sweep"
    result = runner.invoke(app, ["trace", "sweep", str(path), "--source-block-size", "64", "--prefill-only",
                                 "--no-local-reuse", "--max-batch-size", "1", "--capacity", "1e9,64,1e3",
                                 "--tokens-per-block", "16,32", "--jobs", "2", "--output", str(out)])
    assert result.exit_code == 0, result.output
    frame = pd.read_csv(out / "sweep.csv")
    assert list(zip(frame["tokens_per_block"], frame["capacity_tokens"], strict=True)) == [
        (16, 64), (16, 1000), (16, 10**9), (32, 64), (32, 1000), (32, 10**9)]
    prompt = sum(r["input_length"] for r in records)
    for tpb, part in frame.groupby("tokens_per_block"):
        assert list(part["hit_rate"]) == sorted(part["hit_rate"])
        assert part["connector_hit_tokens"].iloc[-1] == sum(reusable_tokens(records, 64, tpb))
        assert part["hit_rate"].iloc[-1] == pytest.approx(part["connector_hit_tokens"].iloc[-1] / prompt, abs=1e-6)
    assert set(frame["tier"]) == {"index"} and not frame["failed_checks"].notna().any()
    assert json.loads((out / "sweep.json").read_text())["rows"][0]["capacity_tokens"] == 64
    for name in ("hit_rate_vs_capacity.png", "hit_rate_vs_tokens_per_block.png", "meta.json"):
        assert (out / name).stat().st_size > 0


def test_a_bytes_sweep_uses_the_host_tier_sized_to_the_same_blocks(tmp_path):
    result = runner.invoke(app, ["trace", "sweep", "workloads/shared_prefix.jsonl", "--no-local-reuse",
                                 "--capacity", "320,1e6", "--jobs", "1", "--format", "json"])
    assert result.exit_code == 0, result.output
    small, large = json.loads(result.stdout)
    assert (small["tier"], small["fidelity"]) == ("host", "bytes")
    assert small["connector_evictions"] > 0 and large["connector_evictions"] == 0
    assert small["connector_hit_tokens"] < large["connector_hit_tokens"]


@pytest.mark.parametrize("args, message", [
    (["--capacity", "1e4,lots"], "--capacity: not a capacity: 'lots': give tokens (1e6) or a size (64GiB, 10GB)"),
    (["--capacity", "0"], "--capacity: a capacity in tokens must be a whole number >= 1"),
    (["--tokens-per-block", "16,x"], "--tokens-per-block: not a whole number: 'x'"),
    (["--tokens-per-block", "-16"], "--tokens-per-block values must be positive"),
    (["--jobs", "0"], "--jobs must be positive"),
    (["--connector-opt", "capacity=5"], "the sweep sets the tier's capacity itself"),
    (["--model", "llama-9"], "unknown model"),
])
def test_bad_sweep_input_exits_2_before_any_replay(args, message):
    result = runner.invoke(app, ["trace", "sweep", "workloads/shared_prefix.jsonl", *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "Traceback" not in result.output
