"""The bundled V2 KV cache manager (see ARCHITECTURE.md for its layers)."""

from kvtool.manager.block_keys import ReuseScope
from kvtool.manager.config import KvCacheManagerConfig
from kvtool.manager.kv_cache import KvCache
from kvtool.manager.layer_groups import BufferId
from kvtool.manager.layout import KvCacheLayerGroupLayout, KvCacheLayout, KvCacheRegion
from kvtool.manager.manager import KvCacheManager, PageHold, compute_layout

__all__ = ["BufferId", "KvCache", "KvCacheLayerGroupLayout", "KvCacheLayout", "KvCacheManager",
           "KvCacheManagerConfig", "KvCacheRegion", "PageHold", "ReuseScope", "compute_layout"]
