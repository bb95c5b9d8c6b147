"""The lock one GPU's tests share under pytest-xdist (tests/gpu/conftest.py says why)."""

from __future__ import annotations

import contextlib
import fcntl
from pathlib import Path

import pytest


def run_lock(config: pytest.Config) -> Path | None:
    """The lock file every worker of this run shares, in the run's temporary folder (pytest-xdist
    gives each worker `--basetemp` inside it); None without workers."""
    if getattr(config, "workerinput", None) is None or not config.option.basetemp:
        return None
    return Path(config.option.basetemp).parent / "gpu.lock"


@contextlib.contextmanager
def gpu_share(lock: Path | None, alone: bool = False):
    """Hold `lock` while the block runs: shared, or exclusive when `alone`; nothing when None."""
    if lock is None:
        yield
        return
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
