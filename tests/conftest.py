"""Shared fixtures: small managers on the CPU."""

from __future__ import annotations

import pytest

from kvtool.manager import KvCacheManager
from tests.helpers.managers import make_manager


@pytest.fixture
def tiny() -> KvCacheManager:
    return make_manager()


@pytest.fixture
def vswa() -> KvCacheManager:
    return make_manager("tiny-vswa", num_slots=16)
