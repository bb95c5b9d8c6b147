"""The shipped example connector passes `kvtool validate`, on kvtool's API and under --compat trtllm."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

EXAMPLE = "examples/dict_connector.py:DictConnectorScheduler:DictConnectorWorker"


@pytest.mark.parametrize("compat", [[], ["--compat", "trtllm"]], ids=["kvtool", "trtllm"])
def test_the_example_connector_passes_validate(tmp_path, compat):
    done = subprocess.run([sys.executable, "-m", "kvtool", "validate", EXAMPLE, *compat, "--output", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert not [r for r in results if r["verdict"] in ("fail", "error")]
    # the one thing it does not do: serve a prompt whose local match ends inside a block
    assert {(r["scenario"], r["check"]) for r in results if r["verdict"] == "miss"} == {("local-prefix", "warm-hit")}
    # ... under every runtime: V1 (one pool tensor, flat hooks) as well as both V2s
    assert {r["runtime"] for r in results if r["verdict"] == "pass"} == {"trtllm-v1", "trtllm-v2", "trtllm-v2-release"}
    summary = " ".join(done.stderr.split())
    assert " checks: " in summary and "(trtllm-v1: " in summary and "failed" not in summary


def test_the_example_imports_tensorrt_llm_when_it_is_there():
    """Under --compat trtllm its classes derive from the modules TensorRT-LLM's connectors import."""
    code = ("from kvtool.connector.compat import install_compat; install_compat('trtllm');"
            "import sys; sys.path.insert(0, 'examples'); import dict_connector as d;"
            "import tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector as k;"
            "assert issubclass(d.DictConnectorScheduler, k.KvCacheConnectorScheduler);"
            "print(sys.modules['tensorrt_llm'].__version__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "kvtool-compat", done.stderr


@pytest.mark.parametrize("ranks", [[], ["--num-ranks", "2", "--tp", "2"]], ids=["1rank", "2ranks"])
def test_trace_run_replays_the_example_under_compat(tmp_path, ranks):
    """`trace run --compat trtllm` loads a connector written against TensorRT-LLM's modules, also in
    the follower ranks' processes (the spec travels with its compat)."""
    done = subprocess.run([sys.executable, "-m", "kvtool", "trace", "run", "workloads/shared_prefix.jsonl",
                           "--connector", EXAMPLE, "--compat", "trtllm", "--no-local-reuse", *ranks,
                           "--output", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["integrity_errors"] == 0 and summary["failed_requests"] == 0
    assert summary["connector_hit_tokens"] > 0
