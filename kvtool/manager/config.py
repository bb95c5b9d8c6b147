"""Configuration of the bundled manager: model, block size, how many slots, which tiers."""

from __future__ import annotations

from dataclasses import dataclass

from kvtool.errors import InputError
from kvtool.models import ModelSpec
from kvtool.types import CacheTier

DEFAULT_TYPICAL_TOKENS = 8192


MAX_TOKENS_PER_BLOCK = 32767
"""A block's token count is an int16 cell of the radix tree (a tree of millions of blocks)."""

@dataclass(frozen=True)
class KvCacheManagerConfig:
    model: ModelSpec
    tokens_per_block: int = 32
    num_slots: int | None = None
    """Slots in every pool group; exclusive with `memory_bytes`."""
    memory_bytes: int | None = None
    """GPU memory for all pools, shared by pool groups as a typical request needs it."""
    typical_tokens: int = DEFAULT_TYPICAL_TOKENS
    device: str | None = None
    """torch device for the pools; None = CUDA when available, else CPU."""
    host_cache_bytes: int = 0
    disk_cache_bytes: int = 0
    swa_scratch_reuse: bool = True
    num_slots_by_pool_group: tuple[int, ...] | None = None
    """Exact slots per pool group, overriding both sizings: another rank's pools, mirrored."""
    poison_new_pages: bool = False
    """Fill every slot with 0xA5 when it is handed out and with 0xDE when it is freed, so reading bytes
    nobody wrote (stale bytes of an earlier request, or a page read after its release) is caught, and
    the two can be told apart; kvtool validate turns it on."""
    keep_reusable_pages: bool = True
    """False: a page only the radix tree references is freed (and poisoned) as soon as its last user
    lets it go (`PageTable.keep_reusable`): for runs that never reuse locally (kvtool validate)."""
    slot_order: str = "fifo"
    """Which free slot an allocation takes (`slot_order.SLOT_ORDERS`): fifo, lifo (the slot freed
    last first) or random (seeded by `slot_order_seed`)."""
    slot_order_seed: int = 0
    virtual: bool = False
    """No memory behind the pools (block fidelity): bases are offsets, pages hold no bytes, and
    poisoning and copy-on-write do nothing."""

    def validate(self) -> None:
        """InputError for values no manager can be built from."""
        if self.tokens_per_block <= 0:
            raise InputError(f"tokens per block must be positive, got {self.tokens_per_block}")
        if self.tokens_per_block > MAX_TOKENS_PER_BLOCK:
            raise InputError(f"tokens per block must be at most {MAX_TOKENS_PER_BLOCK}, got {self.tokens_per_block}")
        if self.num_slots_by_pool_group is None and (self.num_slots is None) == (self.memory_bytes is None):
            raise InputError("give exactly one of num_slots and memory_bytes")
        if self.num_slots is not None and self.num_slots <= 0:
            raise InputError(f"num_slots must be positive, got {self.num_slots}")
        if self.memory_bytes is not None and self.memory_bytes <= 0:
            raise InputError(f"memory must be positive, got {self.memory_bytes} bytes")
        if self.typical_tokens <= 0:
            raise InputError(f"typical_tokens must be positive, got {self.typical_tokens}")

    @property
    def tiers(self) -> tuple[CacheTier, ...]:
        tiers = [CacheTier.GPU]
        if self.host_cache_bytes:
            tiers.append(CacheTier.HOST)
        if self.disk_cache_bytes:
            tiers.append(CacheTier.DISK)
        return tuple(tiers)
