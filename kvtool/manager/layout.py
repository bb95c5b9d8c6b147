"""What a connector worker receives instead of one tensor: the layout of regions per layer group.

A region is bytes: page `i` of the region lives at `base + stride * i` and is `size` bytes long.
Invariants (checked by `check_layout`): the regions of a group are disjoint, lie inside the slot,
and together cover every (layer, role) of the group exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvtool.errors import LayoutError, LogicError, UnknownLayerGroupError
from kvtool.manager.layer_groups import BufferId
from kvtool.models import DTYPES, BufferSpec
from kvtool.types import LayerGroupId, LayerId, MemAddress, PoolGroupIndex, PoolIndex


@dataclass(frozen=True)
class KvCacheRegion:
    base: MemAddress
    size: int
    stride: int
    num_slots: int
    buffers: tuple[BufferId, ...]
    buffer_bytes: int
    """Bytes of each buffer in this region (all buffers of a region have one size)."""
    buffer_specs: tuple[BufferSpec, ...] = field(repr=False, compare=False)
    pool_group_index: PoolGroupIndex = PoolGroupIndex(0)
    pool_index: PoolIndex = PoolIndex(0)
    offset_in_slot: int = 0
    storage: torch.Tensor | None = field(default=None, repr=False, compare=False)
    """The pool's uint8 tensor, or None for a layout computed without allocating."""

    def address_of(self, page_index: int) -> MemAddress:
        """Address of page `page_index`; IndexError outside [0, num_slots)."""
        if not 0 <= page_index < self.num_slots:
            raise IndexError(f"page index {page_index} outside [0, {self.num_slots})")
        return MemAddress(self.base + self.stride * page_index)

    def as_tensor(self, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A strided `[num_slots, size / itemsize]` view of the region's memory.

        ValueError when the item size does not divide size and stride; LayoutError when the
        layout was computed without allocating memory.
        """
        if self.storage is None:
            raise LayoutError("this layout was computed without allocating memory: no tensor to view")
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if self.size % itemsize or self.stride % itemsize or self.offset_in_slot % itemsize:
            raise ValueError(f"item size {itemsize} does not divide region size {self.size} "
                             f"and stride {self.stride}")
        typed = self.storage.view(dtype)
        return typed.as_strided((self.num_slots, self.size // itemsize), (self.stride // itemsize, 1),
                                typed.storage_offset() + self.offset_in_slot // itemsize)

    def slot_tensor(self, page_index: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """Page `page_index`'s `size` bytes as a 1-D view of `dtype` (IndexError outside
        [0, num_slots), so BAD_PAGE_INDEX never aliases the last slot)."""
        self.address_of(page_index)
        return self.as_tensor(dtype)[page_index]

    @property
    def is_replicated(self) -> bool:
        """Every buffer is an MLA latent: the same bytes on every tensor-parallel shard."""
        return bool(self.buffer_specs) and all(spec.latent for spec in self.buffer_specs)

    def buffer_offset(self, buffer: BufferId) -> int:
        """Byte offset of `buffer` inside one page of this region."""
        return self.buffers.index(buffer) * self.buffer_bytes


@dataclass(frozen=True)
class KvCacheLayerGroupLayout:
    layer_group_id: LayerGroupId
    layer_ids: tuple[LayerId, ...]
    window_size: int | None
    regions: tuple[KvCacheRegion, ...]
    pool_group_index: PoolGroupIndex
    num_sink_tokens: int = 0

    @property
    def bytes_per_page(self) -> int:
        return sum(r.size for r in self.regions)

    @property
    def replicated_regions(self) -> tuple[KvCacheRegion, ...]:
        """The regions whose bytes are identical on every tensor-parallel shard (MLA latents), as
        TensorRT-LLM lists them; kvtool keeps them in `regions` too, so `regions` always covers
        every byte of a page (a connector may store these once instead of once per rank)."""
        return tuple(r for r in self.regions if r.is_replicated)

    @property
    def replicated_bytes_per_page(self) -> int:
        return sum(r.size for r in self.replicated_regions)

    def region_of(self, buffer: BufferId) -> KvCacheRegion:
        for region in self.regions:
            if buffer in region.buffers:
                return region
        raise LayoutError(f"buffer {buffer} is not in layer group {self.layer_group_id}")


@dataclass(frozen=True)
class PoolLayout:
    pool_index: PoolIndex
    base: MemAddress
    slot_bytes: int


@dataclass(frozen=True)
class PoolGroupLayout:
    pool_group_index: PoolGroupIndex
    num_slots: int
    layer_group_ids: tuple[LayerGroupId, ...]
    pools: tuple[PoolLayout, ...]

    @property
    def slot_bytes(self) -> int:
        return sum(p.slot_bytes for p in self.pools)


@dataclass(frozen=True)
class KvCacheLayout:
    tokens_per_block: int
    layer_groups: tuple[KvCacheLayerGroupLayout, ...]
    pool_groups: tuple[PoolGroupLayout, ...]
    model_name: str = ""
    dtype_name: str = ""
    is_virtual: bool = False

    def group(self, layer_group_id: int) -> KvCacheLayerGroupLayout:
        """The layout of one layer group; UnknownLayerGroupError (a KeyError) for an unknown id."""
        if not 0 <= layer_group_id < len(self.layer_groups):
            raise UnknownLayerGroupError(f"no layer group {layer_group_id} in layout "
                                         f"(it has {len(self.layer_groups)})")
        return self.layer_groups[layer_group_id]

    def group_of_layer(self, layer_id: int) -> KvCacheLayerGroupLayout:
        """The layer group holding `layer_id`; UnknownLayerGroupError (a KeyError) otherwise."""
        for group in self.layer_groups:
            if layer_id in group.layer_ids:
                return group
        raise UnknownLayerGroupError(f"layer {layer_id} is not covered by this layout")

    @property
    def dtype(self) -> torch.dtype:
        """The KV element type (bytes stay the regions' unit: one region may span several)."""
        return DTYPES[self.dtype_name].torch_dtype if self.dtype_name in DTYPES else torch.uint8

    gpu_pool_mapping_bytes: int | None = None
    """TensorRT-LLM's size of one GPU memory mapping (RDMA registrations must not cross one):
    kvtool's pools are single allocations, so there is no such bound."""

    def as_single_pool_tensor(self) -> torch.Tensor | None:
        """The cache as TensorRT-LLM's primary pool, `[num_slots, num_layers, roles, tokens_per_block
        * heads * head_dim]` of the KV dtype, when it is one layer group with one whole-slot region
        of equal buffers; None otherwise (or for a layout computed without memory). Within a
        (layer, role) buffer kvtool orders token, head, element."""
        shape = self.single_pool_shape()
        if shape is None or self.layer_groups[0].regions[0].storage is None:
            return None
        return self.layer_groups[0].regions[0].as_tensor(self.dtype).view(*shape)

    def single_pool_shape(self) -> tuple[int, int, int, int] | None:
        """`as_single_pool_tensor`'s shape where the cache is one pool of equal buffers (with or
        without memory behind it), else None."""
        if len(self.layer_groups) != 1 or len(self.layer_groups[0].regions) != 1:
            return None
        group, region = self.layer_groups[0], self.layer_groups[0].regions[0]
        spec = region.buffer_specs[0]
        num_layers = len(group.layer_ids)
        if len(region.buffers) % num_layers or region.size != region.stride:
            return None
        roles = len(region.buffers) // num_layers
        return region.num_slots, num_layers, roles, self.tokens_per_block * spec.num_heads * spec.head_dim

    @property
    def num_layer_groups(self) -> int:
        return len(self.layer_groups)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block over every layer group (what a connector stores per block)."""
        return sum(g.bytes_per_page for g in self.layer_groups)

    @property
    def groups(self) -> tuple[KvCacheLayerGroupLayout, ...]:
        """Alias of `layer_groups`, the name the reference runtime's connectors use."""
        return self.layer_groups


def check_layout(layout: KvCacheLayout, expected: dict[LayerGroupId, set[BufferId]]) -> None:
    """Raise LogicError unless every group's regions are disjoint, inside the slot, and cover
    each (layer, role) of `expected[group]` exactly once."""
    for group in layout.layer_groups:
        slot_bytes = layout.pool_groups[group.pool_group_index].slot_bytes
        _check_disjoint_inside(group, slot_bytes)
        seen = [b for r in group.regions for b in r.buffers]
        if len(seen) != len(set(seen)) or set(seen) != expected[group.layer_group_id]:
            raise LogicError(f"layer group {group.layer_group_id}: regions do not cover each "
                             "(layer, role) exactly once")


def _check_disjoint_inside(group: KvCacheLayerGroupLayout, slot_bytes: int) -> None:
    spans = sorted((r.pool_index, r.offset_in_slot, r.offset_in_slot + r.size, r) for r in group.regions)
    for region in group.regions:
        pool_bytes = region.stride
        if region.offset_in_slot + region.size > pool_bytes or region.stride > slot_bytes:
            raise LogicError(f"layer group {group.layer_group_id}: a region leaves its slot")
        if region.size != region.buffer_bytes * len(region.buffers):
            raise LogicError(f"layer group {group.layer_group_id}: region size disagrees with its buffers")
    for (pool_a, _, end_a, _), (pool_b, start_b, _, _) in zip(spans, spans[1:], strict=False):
        if pool_a == pool_b and start_b < end_a:
            raise LogicError(f"layer group {group.layer_group_id}: regions overlap")
