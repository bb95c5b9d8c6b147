"""Small managers on the CPU, for tests."""

from __future__ import annotations

from kvtool.manager import KvCacheManager, KvCacheManagerConfig
from kvtool.models import load_model


def make_manager(model: str = "tiny", tokens_per_block: int = 4, num_slots: int = 8, **kwargs) -> KvCacheManager:
    return KvCacheManager(KvCacheManagerConfig(load_model(model), tokens_per_block, num_slots=num_slots,
                                               device="cpu", **kwargs))
