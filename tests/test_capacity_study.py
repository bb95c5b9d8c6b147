"""The capacity study: sizes in bytes, the no-tier point, the knee and its recommendation, SLO
attainment and cost, the figure, and bad inputs of the new options."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from helpers.traces import random_mooncake_trace
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.report.study_figure import gib_tick, tokens_label
from kvtool.trace.study import knee, recommendation, slo_attainment
from kvtool.units import parse_capacity

runner = CliRunner()
GIB = 2**30


def row(tokens, gib, hit_rate, **extra):
    return {"capacity_tokens": tokens, "capacity_bytes": int(gib * GIB), "hit_rate": hit_rate, **extra}


ROWS = [row(0, 0, 0.20, ttft_p50_s=4.0, ttft_p99_s=20.0, slo_attainment=0.5),
        row(131072, 16, 0.30), row(524288, 64, 0.385, ttft_p50_s=0.8, ttft_p99_s=3.0, slo_attainment=0.97),
        row(2097152, 256, 0.40)]


def test_the_knee_is_the_smallest_capacity_with_95_percent_of_the_plateaus_gain():
    found = knee(ROWS)          # gain 0.20 -> 0.40: the target is 0.39; 64 GiB has 0.385, 256 GiB 0.40
    assert (found.capacity_bytes, found.below_bytes, found.plateau, found.no_tier) == (256 * GIB, 64 * GIB, 0.40, 0.20)
    assert knee([{**r, "hit_rate": 0.39 if r["capacity_tokens"] == 524288 else r["hit_rate"]} for r in ROWS]) \
        .capacity_bytes == 64 * GIB
    assert knee([row(0, 0, 0.5), row(10, 1, 0.5)]) is None            # no gain: no knee


def test_the_recommendation_line_says_the_knee_its_ttft_slo_and_cost():
    rows = [{**r, "hit_rate": 0.39} if r["capacity_tokens"] == 524288 else r for r in ROWS]
    assert recommendation(rows, price_per_gib=3.5, ttft_slo=2.0) == (
        "recommendation: 95% of the plateau's gain at 64 GiB a GPU (524,288 tokens): hit rate 39.00 % of the "
        "plateau's 40.00 % (20.00 % without a tier); 16 GiB was short of it; TTFT p50 800 ms, p99 3.00 s (no tier: "
        "4.00 s, 20.00 s); 97.0 % of requests within the 2 s TTFT SLO (no tier: 50.0 %); 224.00 a GPU at 3.5 a GiB")


def test_slo_attainment_and_labels():
    assert slo_attainment([0.5, 1.0, 2.0, None], 1.0) == 2 / 3 and slo_attainment([None], 1.0) is None
    assert [tokens_label(t) for t in (512, 131072, 1048576, 4.2e9)] == ["512", "131k", "1.05M", "4.2G"]
    assert [gib_tick(g) for g in (0.5, 64, 2048)] == ["0.5 GiB", "64 GiB", "2 TiB"]
    assert parse_capacity("10GB").si_note == "10GB is SI: 10,000,000,000 bytes = 9.31 GiB"
    assert parse_capacity("64GiB").si_note is None and parse_capacity("1e6").tokens == 1_000_000


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    folder = tmp_path_factory.mktemp("study")
    trace = folder / "m.jsonl"
    random_mooncake_trace(trace, 80, 64, seed=11)
    result = runner.invoke(app, ["trace", "sweep", str(trace), "--source-block-size", "64", "--prefill-only",
                                 "--tokens-per-block", "16", "--max-batch-size", "1", "--gpu-memory", "64MiB",
                                 "--capacity", "32MiB,80MiB,0.16GB,1GiB", "--ttft-slo", "0.05",
                                 "--price-per-gib", "2", "--baseline", "--jobs", "2", "--output", str(folder / "out")],
                           env={"COLUMNS": "80"})
    return folder / "out", result


def test_a_study_sweeps_sizes_from_no_tier_up_and_recommends(study):
    out, result = study
    assert result.exit_code == 0, result.output
    frame = pd.read_csv(out / "sweep.csv")
    # llama-3.1-8b, 16 tokens a block: 2 MiB a block; 0.16GB = 76 blocks (76.29)
    assert list(frame["capacity_tokens"]) == [0, 256, 640, 1216, 8192]
    assert list(frame["capacity_bytes"]) == [0, 32 * 2**20, 80 * 2**20, 76 * 2 * 2**20, GIB]
    assert list(frame["tier"]) == ["none", "index", "index", "index", "index"]
    assert frame["connector_hit_tokens"].iloc[0] == 0 and list(frame["hit_rate"]) == sorted(frame["hit_rate"])
    assert list(frame["cost_per_gpu"].round(6)) == [0.0, 0.0625, 0.15625, 0.296875, 2.0]
    assert frame["slo_attainment"].between(0, 1).all()
    assert "kvtool: 0.16GB is SI: 160,000,000 bytes = 0.15 GiB" in result.stderr
    document = json.loads((out / "sweep.json").read_text())
    found = document["study"]["tokens_per_block"]["16"]
    assert found["knee"]["capacity_bytes"] in set(frame["capacity_bytes"])
    assert found["recommendation"].startswith("recommendation: 95% of the plateau's gain at ")
    assert " ".join(found["recommendation"].split()) in " ".join(result.stdout.split())     # printed, wrapped
    assert (out / "capacity_study.png").stat().st_size > 20_000
    assert all(len(line) <= 80 for line in result.stdout.splitlines()) and "…" not in result.stdout


WORKLOAD = "workloads/mooncake_conversation_head200.jsonl"


@pytest.mark.parametrize("args, message", [
    (["--ttft-slo", "0"], "--ttft-slo must be a positive number, got 0.0"),
    (["--ttft-slo", "nan"], "--ttft-slo must be a positive number, got nan"),
    (["--price-per-gib", "-1"], "--price-per-gib must be a positive number, got -1.0"),
    (["--capacity", "64GiB,x"], "--capacity: not a capacity: 'x'"),
    (["--tp", "0"], "--tp must be positive, got 0"),
    (["--gpu", "V100"], "--gpu must be one of H100, H200, B200, got 'V100'"),
])
def test_bad_study_input_exits_2_with_one_line(args, message):
    result = runner.invoke(app, ["trace", "sweep", WORKLOAD, "--prefill-only", *args])
    assert result.exit_code == 2 and message in result.stderr, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output


def test_an_slo_needs_the_cost_model():
    result = runner.invoke(app, ["trace", "sweep", "workloads/shared_prefix.jsonl", "--ttft-slo", "1"])
    assert result.exit_code == 2
    assert "--ttft-slo is judged on the cost model's TTFT, which this sweep has not" in result.stderr
