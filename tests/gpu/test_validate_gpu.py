"""validate on a CUDA machine: scenario processes that can use CUDA after the parent did, and the whole
kit on device pages. Skipped without a GPU."""

from __future__ import annotations

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


def validate(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "kvtool", "validate", *args], capture_output=True, text=True,
                          timeout=900, cwd=tmp_path, env=env)


def test_scenarios_run_after_the_parent_initialised_cuda(tmp_path):
    """The parent builds the connector (pinned buffers: CUDA is initialised) before any scenario."""
    done = validate("host", "--model", "tiny", "--device", "cpu", "--scenario", "cold-warm", tmp_path=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "initialization error" not in done.stdout + done.stderr


@pytest.mark.parametrize("connector", ["host", "host-async", "host-layerwise", "disk"])
def test_the_whole_kit_passes_on_device_pages(connector, tmp_path):
    done = validate(connector, "--device", "cuda", "--output", str(tmp_path / "run"), tmp_path=tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert (tmp_path / "run" / "results.json").exists()
