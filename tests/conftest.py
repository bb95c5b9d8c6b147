"""Shared fixtures: small managers on the CPU."""

from __future__ import annotations

import os

import pytest

from kvtool.manager import KvCacheManager
from tests.helpers.managers import make_manager

# tests/netns runs only inside the private network namespace test_mooncake_connector.py makes.
collect_ignore_glob = [] if os.environ.get("KVTOOL_PRIVATE_NET") == "1" else ["netns/*"]


@pytest.fixture
def tiny() -> KvCacheManager:
    return make_manager()


@pytest.fixture
def vswa() -> KvCacheManager:
    return make_manager("tiny-vswa", num_slots=16)
