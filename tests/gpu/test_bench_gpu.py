"""`kvtool bench --suite store` on GPU pages, with bf16 products beside the saves. Skipped without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = f"{REPO / 'examples/dict_connector.py'}:DictConnectorScheduler:DictConnectorWorker"


@pytest.mark.parametrize("connector", ["host", EXAMPLE])
def test_saves_beside_gpu_products_are_measured_and_verified(connector, tmp_path):
    """llama-3.1-8b at 16 tokens per block: 2 MiB blocks, so a request's save outlasts a 0.2 ms product."""
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "kvtool", "bench", "--suite", "store", "--device", "cuda", "--quick",
                           "--with-compute", "--model", "llama-3.1-8b", "--connector", connector, "--output", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert all(r["verified"] for r in results["rows"])
    rows = results["compute"]
    assert [(r["products"], r["tokens_per_block"], r["verified"]) for r in rows] == [("bf16 4096³ on cuda", 16, True)] * 2
    for row in rows:
        assert row["products_during_saves"] >= 1 and row["slowdown_during_saves"] is not None
        assert row["matmul_ms_alone"] > 0 and row["save_gbps_with_compute"] > 0
