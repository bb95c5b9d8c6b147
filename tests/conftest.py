"""Shared fixtures: small managers on the CPU."""

from __future__ import annotations

import gc
import os

import pytest

from kvtool.manager import KvCacheManager
from tests.helpers.failures_at_once import pytest_configure  # noqa: F401 - names failures as they happen
from tests.helpers.managers import make_manager

# tests/netns runs only inside the private network namespace test_mooncake_connector.py makes.
collect_ignore_glob = [] if os.environ.get("KVTOOL_PRIVATE_NET") == "1" else ["netns/*"]


@pytest.fixture
def tiny() -> KvCacheManager:
    return make_manager()


@pytest.fixture
def vswa() -> KvCacheManager:
    return make_manager("tiny-vswa", num_slots=16)


def pytest_collection_modifyitems(config, items):
    """Tests marked `slow` run first (in their collected order), so that under pytest-xdist the
    longest ones start at once and the workers finish together instead of one ending on a long test.
    `gpu_alone` ones run last: by then most workers have run out of tests, so waiting for the GPU
    alone (tests/gpu/conftest.py) holds back few others. Nothing is deselected: a plain `pytest`
    runs every test."""
    items.sort(key=run_order)    # a stable sort


def run_order(item) -> tuple[bool, bool]:
    """The sort key of `pytest_collection_modifyitems`: `slow` first, `gpu_alone` last."""
    return item.get_closest_marker("slow") is None, item.get_closest_marker("gpu_alone") is not None


def pytest_collection_finish(session):
    """Everything alive once the tests are collected (modules, torch, the collected items) lives for
    the whole session: moved out of the garbage collector's sight. `kvtool validate`'s runner calls
    gc.collect() after every scenario (engines hold reference cycles), and in a process that has
    imported the whole test suite each full collection otherwise walks all of it: this nearly halves
    the time of the in-process validate runs. Objects made later are collected as before."""
    gc.collect()
    gc.freeze()
