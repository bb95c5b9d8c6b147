"""Bounded tiers: a capacity and an eviction policy on the shared Redis store that choose what the
in-process index of the same capacity chooses, and the store never holding more."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis
from helpers.servers import RedisServer, need_redis
from helpers.traces import random_mooncake_trace
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.trace.replay import run_trace
from kvtool.trace.setup import ReplayOptions, build_replay

runner = CliRunner()
SHIPPED = "workloads/shared_prefix.jsonl"


@pytest.fixture(scope="module")
def server():
    need_redis()
    started = RedisServer().start()
    yield started
    started.stop()


def replay(path: Path, connector: str, *options: str):
    built = build_replay(ReplayOptions(path, source_block_size=64, prefill_only=True, tokens_per_block=16,
                                       max_batch_size=1, no_local_reuse=True, connector=connector,
                                       connector_opt=options))
    return run_trace(built.workload.requests(), built.config, built.connector, built.options).summary


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_bounded_redis_tier_evicts_what_the_index_of_its_capacity_evicts(tmp_path, server, policy):
    path = tmp_path / "m.jsonl"
    random_mooncake_trace(path, 80, 64, seed=11)
    index = replay(path, "index", "capacity=640", f"eviction={policy}")
    shared = replay(path, "redis-index", "capacity=640", f"eviction={policy}", f"url={server.url}",
                    f"prefix=bounded-{policy}")
    unbounded = replay(path, "redis-index", f"url={server.url}", f"prefix=unbounded-{policy}")
    assert (shared.connector_hit_tokens, shared.connector_evictions) == \
        (index.connector_hit_tokens, index.connector_evictions)
    assert shared.connector_evictions > 0 and unbounded.connector_evictions is None
    assert shared.connector_hit_tokens < unbounded.connector_hit_tokens
    client = redis.Redis.from_url(server.url)
    (ranks,) = client.keys(f"bounded-{policy}:*index:g0")
    assert client.zcard(ranks) == 640 // 16                        # 40 blocks of 16 tokens, full
    assert len(client.keys(f"bounded-{policy}:*:r0:g0:*")) == 40   # a value for each, no orphan


def test_lfu_keeps_more_of_this_trace_than_lru_at_the_same_capacity(tmp_path):
    path = tmp_path / "m.jsonl"
    random_mooncake_trace(path, 80, 64, seed=11)
    lru, lfu = (replay(path, "index", "capacity=640", f"eviction={p}").connector_hit_tokens for p in ("lru", "lfu"))
    assert (lru, lfu) == (3952, 5231)


def test_a_bounded_redis_tier_with_bytes_serves_verified_blocks(server):
    result = runner.invoke(app, ["trace", "run", SHIPPED, "--no-local-reuse", "--connector", "redis",
                                 "--connector-opt", f"url={server.url}", "--connector-opt", "prefix=bytes",
                                 "--connector-opt", "capacity=1536", "--format", "json"])
    assert result.exit_code == 0, result.output
    assert '"integrity_errors": 0' in result.stdout and '"connector_evictions": 0' not in result.stdout


def test_capacity_in_bytes_counts_whole_blocks_of_the_shard(tmp_path):
    """80 MiB of llama-3.1-8b's 16-token blocks (2 MiB each: 32 layers x K, V x 8 heads x 128 dims
    x bf16 x 16) hold 40 blocks, as `capacity=640` tokens does; 81 MiB still 40."""
    path = tmp_path / "m.jsonl"
    random_mooncake_trace(path, 80, 64, seed=11)
    summaries = [replay(path, "index", f"capacity={c}") for c in ("80MiB", "81MiB", "640")]
    assert len({(s.connector_hit_tokens, s.connector_evictions) for s in summaries}) == 1
    assert summaries[0].connector_hit_tokens == 3952


@pytest.mark.parametrize("connector, option, message", [
    ("index", "eviction=fifo", "option eviction='fifo' must be one of lru, lfu"),
    ("host", "eviction=mru", "option eviction='mru' must be one of lru, lfu"),
    ("index", "capacity=lots", "not a capacity: 'lots': give tokens (1e6) or a size (64GiB, 10GB)"),
    ("redis-index", "capacity=0", "a capacity in tokens must be a whole number >= 1"),
    ("redis-index", "eviction=random", "option eviction='random' must be one of lru, lfu"),
])
def test_bad_tier_options_exit_2_with_one_line(connector, option, message):
    result = runner.invoke(app, ["trace", "run", "workloads/mooncake_conversation_head200.jsonl", "--connector",
                                 connector, "--connector-opt", option])
    assert result.exit_code == 2 and message in result.stderr, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output


def test_at_equal_total_capacity_one_pooled_tier_serves_more_than_private_ones(tmp_path, server):
    """Mooncake's Fig. 10 question in small: two engines, round-robin, 1,280 tokens of tier in all,
    as one shared Redis or as 640 each."""
    path = tmp_path / "m.jsonl"
    random_mooncake_trace(path, 120, 64, seed=21)
    common = ["trace", "run", str(path), "--source-block-size", "64", "--prefill-only", "--tokens-per-block", "16",
              "--no-local-reuse", "--instances", "2", "--format", "json"]
    pooled = runner.invoke(app, [*common, "--connector", "redis-index", "--connector-opt", "capacity=1280",
                                 "--connector-opt", f"url={server.url}", "--connector-opt", "prefix=fig10"])
    private = runner.invoke(app, [*common, "--connector", "index", "--connector-opt", "capacity=640"])
    assert pooled.exit_code == 0 and private.exit_code == 0, pooled.output + private.output
    shared, own = (json.loads(r.stdout)["all"] for r in (pooled, private))
    assert shared["connector_hit_tokens"] > own["connector_hit_tokens"] > 0
    assert shared["prompt_tokens"] == own["prompt_tokens"] and shared["integrity_errors"] == 0
