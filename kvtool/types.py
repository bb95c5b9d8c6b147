"""Identifier types, sentinels and small enums shared by every layer of kvtool.

Ids are `NewType`s over int so that a layer id is never passed where a page index is expected;
`BAD_PAGE_INDEX` is the one sentinel for "no page here" and is never written as a bare -1.
"""

from __future__ import annotations

import enum
from typing import Final, NewType

LayerId = NewType("LayerId", int)
LayerGroupId = NewType("LayerGroupId", int)
PoolGroupIndex = NewType("PoolGroupIndex", int)
PoolIndex = NewType("PoolIndex", int)
PageIndex = NewType("PageIndex", int)
"""A slot id inside one pool group; scoped to that pool group."""
BlockOrdinal = NewType("BlockOrdinal", int)
RequestId = NewType("RequestId", int)
Priority = NewType("Priority", int)
MemAddress = NewType("MemAddress", int)

BAD_PAGE_INDEX: Final[PageIndex] = PageIndex(-1)
"""This block has no page in this layer group (a sliding-window stale block); kept in place."""

DEFAULT_PRIORITY: Final[Priority] = Priority(50)
POOL_ALIGNMENT: Final[int] = 2 * 1024 * 1024
"""Pools of a virtual layout are placed at offsets aligned to 2 MiB."""


class TextEnum(str, enum.Enum):
    """An enum whose members are their text: printed, formatted and serialised as the value (the
    same on every Python), and equal to that text, so reports and JSON read as before."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Fidelity(TextEnum):
    """How much of the KV a run really moves (`kvtool.engine.fidelity`)."""

    BYTES = "bytes"
    """Pools hold KV bytes the fake engine writes and verifies."""
    BLOCKS = "blocks"
    """Virtual pools: every page decision kept, nothing written or verified."""
    TOKENS = "tokens"
    """The tokens BYTES would generate, nothing written: a reference run's."""


class Admission(TextEnum):
    """Which requests a pass admits (TensorRT-LLM's capacity scheduler policies)."""

    RESERVE = "reserve"
    """GUARANTEED_NO_EVICT: only a request whose whole output fits beside the running ones'."""
    GREEDY = "greedy"
    """Whenever its first chunk gets pages."""
    MAX_UTILIZATION = "max-utilization"
    """Greedy, pausing the newest request when a running one cannot grow."""


class Role(str, enum.Enum):
    """The part of a layer's KV a buffer holds. MLA models only have `key`."""

    KEY = "key"
    VALUE = "value"


class CacheTier(enum.IntEnum):
    GPU = 0
    HOST = 1
    DISK = 2


class PageStatus(enum.Enum):
    """LOCKED: used by an active cache. HELD: used only by suspended caches or an async-save hold.
    DROPPABLE: referenced only by the radix tree, so eviction may reclaim its slot."""

    LOCKED = "locked"
    HELD = "held"
    DROPPABLE = "droppable"


class KvCacheStatus(enum.Enum):
    SUSPENDED = "suspended"
    ACTIVE = "active"
    CLOSED = "closed"
