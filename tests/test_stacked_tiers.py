"""Stacked tiers (`stacked-index`): GPU -> host -> a shared remote, per-tier hits, each tier's load
rate in the cost model."""

from __future__ import annotations

import json

import pytest
from helpers.servers import RedisServer, need_redis
from helpers.traces import random_mooncake_trace
from typer.testing import CliRunner

from kvtool.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def server():
    need_redis()
    started = RedisServer().start()
    yield started
    started.stop()


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("stacked") / "m.jsonl"
    random_mooncake_trace(path, 80, 64, seed=11)
    return path


def run(trace, *args, output=None):
    out = output or (trace.parent / "run")
    result = runner.invoke(app, ["trace", "run", str(trace), "--source-block-size", "64", "--prefill-only",
                                 "--tokens-per-block", "16", "--max-batch-size", "1", "--no-local-reuse", *args,
                                 "--output", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return json.loads((out / "summary.json").read_text()), result


def test_each_tier_serves_its_share_and_together_they_serve_what_one_unbounded_tier_does(trace, server):
    stacked, result = run(trace, "--connector", "stacked-index", "--connector-opt", "capacity=320",
                          "--connector-opt", f"url={server.url}", "--connector-opt", "prefix=stack-a")
    unbounded, _ = run(trace, "--connector", "index", "--connector-opt", "capacity=1e9")
    tiers = stacked["tier_hit_tokens"]
    assert tiers["host"] > 0 and tiers["remote"] > 0
    assert tiers["host"] + tiers["remote"] == stacked["connector_hit_tokens"] == unbounded["connector_hit_tokens"]
    assert "│   remote tier " in result.stdout


def test_a_bounded_remote_level_serves_less(trace, server):
    full, _ = run(trace, "--connector", "stacked-index", "--connector-opt", "capacity=320", "--connector-opt",
                  f"url={server.url}", "--connector-opt", "prefix=stack-b")
    bounded, _ = run(trace, "--connector", "stacked-index", "--connector-opt", "capacity=320", "--connector-opt",
                     f"url={server.url}", "--connector-opt", "prefix=stack-c", "--connector-opt", "remote_capacity=640")
    assert bounded["tier_hit_tokens"]["remote"] < full["tier_hit_tokens"]["remote"]


def test_the_remote_tiers_loads_cost_its_own_rate(trace, server, tmp_path):
    ttft = {}
    for gbps in ("1", "1000"):
        summary, _ = run(trace, "--connector", "stacked-index", "--connector-opt", "capacity=320", "--connector-opt",
                         f"url={server.url}", "--connector-opt", f"prefix=stack-{gbps}", "--cost-model",
                         "--remote-gbps", gbps, output=tmp_path / gbps)
        ttft[gbps] = summary["ttft"]["with_connector"]["mean"]
        meta = json.loads((tmp_path / gbps / "meta.json").read_text())
        assert meta["cost_model"]["tier_gbps"]["remote"] == float(gbps)
    assert ttft["1"] > ttft["1000"]


@pytest.mark.parametrize("args, message", [
    (["--remote-gbps", "0"], "--remote-gbps must be a positive number, got 0.0"),
    (["--connector-opt", "remote_capacity=x"], "option remote_capacity='x': not a capacity"),
    (["--connector-opt", "remote_eviction=clock"], "option remote_eviction='clock' must be one of lru, lfu"),
])
def test_bad_stacked_options_exit_2_with_one_line(args, message):
    result = runner.invoke(app, ["trace", "run", "workloads/mooncake_conversation_head200.jsonl", "--connector",
                                 "stacked-index", *args])
    assert result.exit_code == 2 and message in result.stderr, result.output
    assert len(result.stderr.strip().splitlines()) == 1
