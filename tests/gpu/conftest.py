"""One GPU shared by pytest-xdist's workers: the tests that time products on the GPU run with it alone.

`python -m pytest tests/gpu` runs with the project's addopts (up to 8 workers), so the validations,
benches and worker-thread scripts of different files overlap on the one GPU. That is fine for tests
that check bytes and outcomes, not for one that compares how long GPU products take
(`gpu_alone`): every test holds a shared lock on one file per test run while it runs, and a
`gpu_alone` test holds it exclusively, so it starts once every other worker's test has ended and
none starts until it ends (module fixtures included: the lock is held around a test's whole
run). Without workers (`-n 0`) nothing overlaps and no lock is taken."""

from __future__ import annotations

import os
import time

import pytest

from tests.helpers.gpu_share import gpu_share, run_lock


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Every test's lock, around its setup, call and teardown (fixtures of any scope made or
    finished there included); its worker, its start and how long it waited for the GPU land in
    the JUnit report's properties (what a slow run on the GPU machine is read from)."""
    alone = item.get_closest_marker("gpu_alone") is not None
    asked = time.time()
    with gpu_share(run_lock(item.config), alone):
        started = time.time()
        item.user_properties += [("worker", os.environ.get("PYTEST_XDIST_WORKER", "main")),
                                 ("started", f"{started:.2f}"), ("gpu_lock_wait_s", f"{started - asked:.2f}")]
        yield
