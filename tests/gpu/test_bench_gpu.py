"""`kvtool bench --suite store` on GPU pages, with bf16 products beside the saves. Skipped without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtool.bench.protocol_compute import run_compute_suite
from kvtool.bench.protocol_engine import scratch_working_folder
from kvtool.bench.protocol_suite import QUICK
from kvtool.connectors.registry import load_connector

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = f"{REPO / 'examples/dict_connector.py'}:DictConnectorScheduler:DictConnectorWorker"


@pytest.mark.slow
@pytest.mark.parametrize("connector", ["host", EXAMPLE])
def test_saves_beside_gpu_products_are_measured_and_verified(connector, tmp_path):
    """llama-3.1-8b at 16 tokens per block: 2 MiB blocks, so a pass's saves outlast a 0.8 ms product."""
    results = _bench(connector, "llama-3.1-8b", tmp_path)
    assert all(r["verified"] for r in results["rows"])
    rows = results["compute"]
    assert [(r["products"], r["tokens_per_block"], r["verified"]) for r in rows] == \
        [("bf16 4096³ x4 on cuda", 16, True)] * 2
    for row in rows:
        assert row["products_during_saves"] >= 1 and row["slowdown_during_saves"] is not None
        assert row["matmul_ms_alone"] > 0 and row["save_gbps_with_compute"] > 0


SAVES = """
import time
import torch
from dict_connector import DictConnectorScheduler, DictConnectorWorker


class SpinningWorker(DictConnectorWorker):
    def wait_for_save(self, stream):
        end = time.perf_counter() + 0.03          # Python holds the interpreter; the GPU idles
        while time.perf_counter() < end:
            pass
        super().wait_for_save(stream)


class HoggingWorker(DictConnectorWorker):
    def wait_for_save(self, stream):
        if not hasattr(self, "hog"):
            self.hog = torch.ones(4096, 4096, device="cuda", dtype=torch.bfloat16), torch.cuda.Stream()
        matrix, side = self.hog
        with torch.cuda.stream(side):             # about 30 ms of products as large as the load's
            for _ in range(150):
                torch.mm(matrix, matrix)
        side.synchronize()
        super().wait_for_save(stream)
"""
SPIN_BOUND = 0.3
"""`slowdown_during_saves` a save that only spins Python stays under. Alone on an H100 it read
-0.066 to +0.179 over six runs (0.0417, -0.0655, -0.055, 0.0837, -0.0044 and 0.179 at cd95616), so
the 0.05 it was held to before failed two runs of six: products back to back inside a spin and
products beside the engine's own work run at different clocks. A save that keeps the GPU busy
(`HoggingWorker`, products as large as the load's on a stream of its own) shares the SMs with the
load: it must read above this bound."""


@pytest.mark.gpu_alone
def test_a_save_that_only_spins_python_reads_below_one_that_keeps_the_gpu_busy(tmp_path, monkeypatch):
    """The products share the interpreter with the engine: a hook spinning in Python must not read as
    GPU interference (batches whose stream idled waiting for the interpreter are dropped), and one
    that runs products of its own must. It times products, so no other test of the run may use the
    GPU meanwhile (`gpu_alone`); it runs the compute rounds of `bench --suite store --with-compute
    --quick` in this process, whose CUDA is up already, to hold the GPU alone as briefly as it can."""
    (tmp_path / "saves.py").write_text(SAVES)
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    targets = [(load_connector(f"{tmp_path / 'saves.py'}:DictConnectorScheduler:{worker}"), {}, label)
               for worker, label in (("SpinningWorker", "spinning"), ("HoggingWorker", "hogging"))]
    rows: list = []
    with scratch_working_folder():
        problems = run_compute_suite(targets, "tiny", [16], QUICK, "cuda", rows)      # one block size: two rows
    readings = json.dumps([r.as_dict() for r in rows], indent=1)
    print(readings)          # gpu-sessions/gpu-session keeps it (-rP): the readings, passed or not
    assert problems == [] and [r.verified for r in rows] == [True, True], readings
    spinning, hogging = rows
    # products beside the busy save take about twice as long: fewer fit its spans
    assert spinning.products_during_saves >= 20 and hogging.products_during_saves >= 10, readings
    assert spinning.slowdown_during_saves < SPIN_BOUND < hogging.slowdown_during_saves, readings


def _bench(connector: str, model: str, tmp_path: Path) -> dict:
    out = tmp_path / "run"
    path = [str(REPO), os.environ.get("PYTHONPATH", "")]
    done = subprocess.run([sys.executable, "-m", "kvtool", "bench", "--suite", "store", "--device", "cuda", "--quick",
                           "--with-compute", "--model", model, "--connector", connector, "--output", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(path)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "results.json").read_text())
