"""Block fidelity against bytes fidelity, and replays against the reuse a trace's ids allow."""

import json

import pytest
from helpers.traces import random_mooncake_trace, reusable_tokens
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.trace.replay import run_trace
from kvtool.trace.setup import ReplayOptions, build_replay

runner = CliRunner()
TINY_BLOCK_BYTES_PER_TOKEN = 2 * 4 * 2 * 16 * 2   # K and V x 4 layers x 2 heads x 16 dims x bf16
COUNTS = ("prompt_tokens", "computed_tokens", "local_hit_tokens", "connector_hit_tokens", "cancelled_tokens",
          "saved_blocks", "loaded_blocks", "connector_evictions", "evictions", "iterations", "deferrals",
          "generated_tokens")


def summary(tmp_path, name, *args):
    out = tmp_path / name
    result = runner.invoke(app, ["trace", "run", *map(str, args), "--output", str(out)])
    assert result.exit_code == 0, result.output
    return json.loads((out / "summary.json").read_text())


def both_fidelities(tmp_path, workload, capacity_blocks, tpb, *args):
    """(bytes fidelity with the host tier, block fidelity with the index tier) of one capacity."""
    host = summary(tmp_path, "bytes", workload, "--fidelity", "bytes", "--connector", "host", "--connector-opt",
                   f"capacity={capacity_blocks * tpb * TINY_BLOCK_BYTES_PER_TOKEN}", "--tokens-per-block", tpb,
                   "--model", "tiny", *args)
    index = summary(tmp_path, "blocks", workload, "--fidelity", "blocks", "--connector", "index",
                    "--connector-opt", f"capacity={capacity_blocks * tpb}", "--tokens-per-block", tpb,
                    "--model", "tiny", *args)
    return host, index


@pytest.mark.parametrize("capacity_blocks, extra", [(4096, ["--no-local-reuse"]), (40, ["--no-local-reuse"]),
                                                     (60, ["--num-slots", "48"])])
def test_both_fidelities_count_the_same_on_the_shipped_workload(tmp_path, capacity_blocks, extra):
    host, index = both_fidelities(tmp_path, "workloads/shared_prefix.jsonl", capacity_blocks, 32, *extra)
    assert {k: host[k] for k in COUNTS} == {k: index[k] for k in COUNTS}
    assert host["connector_hit_tokens"] > 0 and host["integrity_errors"] == 0
    if capacity_blocks == 40:
        assert host["connector_evictions"] > 0


def test_both_fidelities_count_the_same_on_an_imported_trace(tmp_path):
    path = tmp_path / "m.jsonl"
    random_mooncake_trace(path, 40, 64, seed=3)
    host, index = both_fidelities(tmp_path, path, 50, 16, "--source-block-size", 64, "--no-local-reuse",
                                  "--max-batch-size", 4)
    assert {k: host[k] for k in COUNTS} == {k: index[k] for k in COUNTS}
    assert host["connector_hit_tokens"] > 0 and host["connector_evictions"] > 0


def replay_hits(path, block_size, tpb, capacity="1e9", **overrides):
    options = dict(source_block_size=block_size, prefill_only=True, tokens_per_block=tpb, max_batch_size=1,
                   connector="index", connector_opt=(f"capacity={capacity}",), no_local_reuse=True)
    replay = build_replay(ReplayOptions(path, **{**options, **overrides}))
    result = run_trace(replay.workload.requests(), replay.config, replay.connector, replay.options)
    assert not result.failed_checks
    return result


@pytest.mark.parametrize("tpb, block_size", [(16, 64), (32, 64), (48, 64), (16, 16), (128, 64)])
def test_an_unbounded_tier_serves_exactly_the_reuse_the_ids_allow(tmp_path, tpb, block_size):
    path = tmp_path / "m.jsonl"
    records = random_mooncake_trace(path, 60, block_size, seed=tpb + block_size)
    rows = sorted(replay_hits(path, block_size, tpb).recorder.requests, key=lambda r: r.request_id)
    assert [r.connector_hit_tokens for r in rows] == reusable_tokens(records, block_size, tpb)


def test_the_hit_rate_never_falls_as_the_tier_grows_and_plateaus_at_the_bound(tmp_path):
    path = tmp_path / "m.jsonl"
    records = random_mooncake_trace(path, 80, 64, seed=11)
    bound = sum(reusable_tokens(records, 64, 16))
    hits = [replay_hits(path, 64, 16, capacity).summary.connector_hit_tokens
            for capacity in (16, 256, 1024, 4096, 10**5, 10**9)]
    assert hits == sorted(hits) and hits[0] < hits[2] < hits[3] < hits[-1]
    assert hits[-1] == hits[-2] == bound


def test_local_reuse_finds_at_least_what_the_tier_finds(tmp_path):
    path = tmp_path / "m.jsonl"
    records = random_mooncake_trace(path, 60, 64, seed=5)
    result = replay_hits(path, 64, 16, connector="none", connector_opt=(), no_local_reuse=False)
    assert result.summary.local_hit_tokens >= sum(reusable_tokens(records, 64, 16))


def test_reserving_outputs_avoids_the_greedy_deadlock(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text("".join(json.dumps({"request_id": i, "prompt": [i + 1] * 40, "max_new_tokens": 60})
                            + "\n" for i in range(8)))
    args = ["trace", "run", str(path), "--tokens-per-block", "16", "--num-slots", "24", "--format", "json"]
    greedy = runner.invoke(app, [*args, "--admission", "greedy"])
    assert greedy.exit_code == 2 and "--admission reserve" in greedy.stderr
    reserve = runner.invoke(app, [*args, "--admission", "reserve"])
    assert reserve.exit_code == 0, reserve.output
    done = json.loads(reserve.stdout)
    # 100 tokens need 7 of the 24 blocks: three requests run at once, the rest wait their turn
    assert done["generated_tokens"] == 8 * 60 and done["failed_requests"] == 0 and done["deferrals"] > 0
