"""The mooncake connector's tests (tests/netns/) run in a private network namespace: a Mooncake
master binds every interface, so master, pool and clients must be reachable from nowhere else."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.servers import mooncake_binary

ROOT = Path(__file__).resolve().parents[1]


def _why_not() -> str | None:
    if sys.platform != "linux" or os.geteuid() != 0:
        return "needs root on Linux for a private network namespace (unshare -n)"
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "needs unshare and ip (util-linux, iproute2)"
    if mooncake_binary("mooncake_master") is None or mooncake_binary("mooncake_client") is None:
        return "Mooncake Store is not installed (pip install 'kvtool[mooncake]')"
    probe = subprocess.run([sys.executable, "-c", "import mooncake.store"], capture_output=True, text=True)
    if probe.returncode != 0:
        last = probe.stderr.strip().splitlines()[-1]
        return f"mooncake.store does not import ({last}; apt-get install -y libibverbs1)"
    return None


@pytest.mark.slow
def test_mooncake_cases_in_a_private_network_namespace():
    """Two pytest-xdist workers inside, each with a store of its own: the two long command-line tests
    (validate, two instances) run side by side."""
    why = _why_not()
    if why:
        pytest.skip(why)
    done = subprocess.run(
        ["unshare", "-n", "--", "sh", "-c",
         f"ip link set lo up && exec {sys.executable} -m pytest -q -p no:cacheprovider -n 2 tests/netns"],
        cwd=ROOT, capture_output=True, text=True, timeout=1200, env={**os.environ, "KVTOOL_PRIVATE_NET": "1"})
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1], done.stdout[-2000:]
