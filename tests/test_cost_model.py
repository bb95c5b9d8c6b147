"""The cost model (decode memory-bound, prefill compute-bound, batching, tensor parallelism), the GPU
presets, the GPU pool from the model, the overload check, and their bad inputs."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.errors import InputError
from kvtool.models import load_model
from kvtool.trace.cost_model import cost_model_for
from kvtool.trace.gpu_pool import gpu_pool
from kvtool.trace.gpus import gpu_named
from kvtool.trace.load_check import LoadCheck, load_check
from kvtool.trace.model_compute import model_compute
from kvtool.trace.recorder import RequestRow

runner = CliRunner()
KV_8B, KV_70B = 131072, 327680            # bytes of KV a token: 32 (80) layers x K, V x 8 heads x 128 x bf16


def model(name: str, tp: int = 1, gpu: str = "H200"):
    spec = load_model(name)
    return cost_model_for(spec, model_compute(spec), gpu_named(gpu), KV_8B if "8b" in name else KV_70B, tp)


def test_a_decode_step_reads_the_weights_and_its_kv_at_the_hbm_rate_and_batching_shares_the_weights():
    cost = model("llama-3.1-8b")
    one = cost.pass_seconds([(100, 101)])
    eight = cost.pass_seconds([(100, 101)] * 8)
    assert eight == pytest.approx((16.06e9 + 8 * 101 * KV_8B) / 3888e9)        # 4.158 ms: memory-bound
    assert one == pytest.approx((16.06e9 + 101 * KV_8B) / 3888e9) and eight < 1.03 * one


def test_a_prefill_is_compute_bound():
    cost = model("llama-3.1-8b")
    flops = 2 * 8.03e9 * 4096 + 4 * 32 * 4096 * (4096 * 4097 / 2)
    assert cost.pass_seconds([(0, 4096)]) == pytest.approx(flops / 750e12) == cost.compute_seconds(0, 4096)


def test_tensor_parallelism_divides_compute_and_weights_and_adds_all_reduces():
    one, four = model("llama-3.1-70b"), model("llama-3.1-70b", tp=4)
    allreduce = 2 * 80 * (8e-6 + 1.5 * 8 * 8192 * 2 / 450e9)
    assert four.allreduce_seconds(8) == pytest.approx(allreduce) and one.allreduce_seconds(8) == 0
    assert four.pass_seconds([(100, 101)] * 8) == pytest.approx((141.2e9 + 8 * 101 * KV_70B) / (4 * 3888e9) + allreduce)
    assert four.compute_seconds(0, 4096) == pytest.approx(one.compute_seconds(0, 4096) / 4)
    assert four.load_seconds(1000) == pytest.approx(1000 * KV_70B / 4 / 51e9)


def test_gpu_presets_scale_the_measured_h200_fractions_and_take_overrides():
    h100, h200, b200 = (gpu_named(n) for n in ("H100", "h200", "B200"))
    assert (h100.tflops, h100.hbm_gbps, h100.memory_bytes) == (750.0, 2713.5, 81_559 * 2**20)
    assert (h200.tflops, h200.hbm_gbps, h200.memory_bytes) == (750.0, 3888.0, 143_771 * 2**20)
    assert (b200.tflops, b200.hbm_gbps, b200.nvlink_gbps) == (1706.3, 6480.0, 900.0)
    assert gpu_named(None, tflops=600, hbm_gbps=3000).tflops == 600 and gpu_named("H200").load_gbps == 51.0


def test_the_gpu_pool_is_what_the_weights_and_the_reserve_leave():
    h200 = gpu_named("H200")
    pool = gpu_pool(h200, 16.06e9, 1, "llama-3.1-8b")
    assert pool.pool_bytes == 143_771 * 2**20 - 16_060_000_000 - int(0.1 * 143_771 * 2**20)
    assert pool.pool_bytes // KV_8B == 912_623                                       # tokens of KV
    assert gpu_pool(h200, 141.2e9, 4, "llama-3.1-70b").pool_bytes == 100_379_338_087
    with pytest.raises(InputError, match=r"llama-3.1-70b's weights \(131.5 GiB, 131.5 GiB a GPU at --tp 1\) leave "
                                         r"no KV pool on an H200 \(140.4 GiB, 10% kept for activations\): give a "
                                         r"larger --tp, another --gpu, or the pool itself with --gpu-memory"):
        gpu_pool(h200, 141.2e9, 1, "llama-3.1-70b")


def test_the_replay_states_its_pool_in_the_summary_and_meta(tmp_path):
    result = runner.invoke(app, ["trace", "run", "workloads/mooncake_conversation_head200.jsonl", "--prefill-only",
                                 "--model", "llama-3.1-70b", "--tp", "4", "--output", str(tmp_path / "run")],
                           env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert summary["gpu_pool_tokens"] == 100_379_338_087 // (KV_70B // 4) // 32 * 32     # a GPU's shard
    assert meta["gpu_pool"]["pool_bytes"] == 100_379_338_087 and meta["gpu_pool"]["tp"] == 4
    assert meta["cost_model"]["tp"] == 4 and meta["cost_model"]["gpu"] == "H200"
    assert "GPU pool 93.49 GiB a GPU: H200's 140.4 GiB less llama-3.1-70b's weights" in result.stdout


def test_vllms_published_latency_run_replayed(tmp_path):
    """vLLM's nightly latency test (8 requests of 32 prompt tokens, 128 generated, at once; H200
    build 9513: llama-3.1-8b tp1 834.1 ms, llama-3 70b tp4 2075.1 ms) under the cost model: 36 %
    and 35 % short (docs/trace-replay.md states it)."""
    path = tmp_path / "latency.jsonl"
    path.write_text("".join(json.dumps({"request_id": i, "prompt": list(range(1000 * i, 1000 * i + 32)),
                                        "max_new_tokens": 128}) + "\n" for i in range(8)))
    seconds = {}
    for name, args in (("8b", ["--model", "llama-3.1-8b"]), ("70b", ["--model", "llama-3.1-70b", "--tp", "4"])):
        result = runner.invoke(app, ["trace", "run", str(path), *args, "--gpu", "H200", "--fidelity", "blocks",
                                     "--cost-model", "--format", "json"])
        assert result.exit_code == 0, result.output
        seconds[name] = json.loads(result.stdout)["simulated_seconds"]
    assert seconds == {"8b": 0.533367, "70b": 1.342123}
    assert round(seconds["8b"] / 0.834059 - 1, 3) == -0.361 and round(seconds["70b"] / 2.07508 - 1, 3) == -0.353


def rows(arrivals, scheduled, first_tokens, ends):
    return [RequestRow(i, a, 100, first_scheduled=s, first_token=f, finished=e)
            for i, (a, s, f, e) in enumerate(zip(arrivals, scheduled, first_tokens, ends, strict=True))]


def test_an_engine_that_falls_behind_its_arrivals_is_said_to_be_overloaded():
    behind = load_check(rows([0, 1, 2, 3], [0, 4, 8, 12], [3, 7, 11, 15], [3, 7, 11, 15]))
    assert behind == LoadCheck(arrival_rate=4 / 3, served_rate=4 / 15, prompt_tokens_per_s=400 / 3,
                               queue_p50_s=4.5, ttft_p50_s=7.5)       # queued 0, 3, 6, 9; TTFT 3, 6, 9, 12
    assert behind.overloaded
    assert "requests arrive at 1.33/s (133 prompt tokens/s) and it served 0.267/s" in behind.note()
    keeping_up = load_check(rows([0, 1, 2, 3], [0, 1, 2, 3], [0.5, 1.5, 2.5, 3.5], [0.5, 1.5, 2.5, 3.5]))
    assert not keeping_up.overloaded and keeping_up.note() is None
    assert load_check(rows([0, 0], [0, 1], [1, 2], [1, 2])) is None                 # a batch: no rate


WORKLOAD = "workloads/mooncake_conversation_head200.jsonl"


@pytest.mark.parametrize("args, message", [
    (["--gpu", "A100"], "--gpu must be one of H100, H200, B200, got 'A100'"),
    (["--hbm-gbps", "0"], "--hbm-gbps must be a positive number, got 0.0"),
    (["--tflops", "-1"], "--tflops must be a positive number, got -1.0"),
    (["--load-gbps", "inf"], "--load-gbps must be a positive number, got inf"),
    (["--model", "llama-3.1-70b"], "llama-3.1-70b's weights (131.5 GiB, 131.5 GiB a GPU at --tp 1) leave no KV pool"),
    (["--model", "llama-3.1-70b", "--tp", "3"], "--tp 3 does not divide the 8 KV heads of llama-3.1-70b"),
])
def test_bad_cost_model_and_gpu_input_exits_2_with_one_line(args, message):
    result = runner.invoke(app, ["trace", "run", WORKLOAD, "--prefill-only", *args])
    assert result.exit_code == 2 and message in result.stderr, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output


def test_a_baseline_without_a_cost_model_says_why_and_how_to_turn_it_on():
    result = runner.invoke(app, ["trace", "run", "workloads/shared_prefix.jsonl", "--connector", "host", "--baseline"])
    assert result.exit_code == 2
    assert result.stderr.strip() == ("kvtool: error: --baseline compares TTFT with and without the connector, and this "
                                     "replay has no cost model (off by default for kvtool workloads: 10 ms an "
                                     "iteration): add --cost-model (--gpu and --model say what it prices)")
