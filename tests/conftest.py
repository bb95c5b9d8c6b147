"""Shared fixtures: small managers on the CPU."""

from __future__ import annotations

import pytest

from kvtool.manager import KvCacheManager, KvCacheManagerConfig
from kvtool.models import load_model


def make_manager(model: str = "tiny", tokens_per_block: int = 4, num_slots: int = 8, **kwargs) -> KvCacheManager:
    return KvCacheManager(KvCacheManagerConfig(load_model(model), tokens_per_block, num_slots=num_slots,
                                               device="cpu", **kwargs))


@pytest.fixture
def tiny() -> KvCacheManager:
    return make_manager()


@pytest.fixture
def vswa() -> KvCacheManager:
    return make_manager("tiny-vswa", num_slots=16)
