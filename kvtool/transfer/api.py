"""The transfer interface: page spaces, copy operations, and the backend protocol.

A `PageSpace` is a set of equal-stride slots inside one uint8 tensor: a region of the KV cache
(GPU or CPU) or a host/staging store. A `CopyOp` copies, for each pair (src slot, dst slot), the
`nbytes` at `src_offset` inside the source slot to `dst_offset` inside the destination slot:
whole slots, or sub-slot chunks such as one layer's buffers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from kvtool.errors import LogicError

if TYPE_CHECKING:
    from kvtool.manager.layout import KvCacheRegion


@dataclass(frozen=True)
class PageSpace:
    tensor: torch.Tensor = field(repr=False)
    """1-D uint8 tensor holding the slots."""
    stride: int
    size: int
    num_slots: int
    offset: int = 0
    """Byte offset of slot 0 inside `tensor`."""

    def __post_init__(self) -> None:
        if self.tensor.dtype != torch.uint8 or self.tensor.dim() != 1:
            raise LogicError("a page space needs a 1-D uint8 tensor")
        if self.num_slots and self.offset + self.stride * (self.num_slots - 1) + self.size > self.tensor.numel():
            raise LogicError("page space slots run past the end of its tensor")

    @staticmethod
    def of_region(region: KvCacheRegion) -> PageSpace:
        if region.storage is None:
            raise LogicError("a virtual layout has no memory to copy")
        return PageSpace(region.storage, region.stride, region.size, region.num_slots, region.offset_in_slot)

    @staticmethod
    def contiguous(tensor: torch.Tensor, slot_bytes: int) -> PageSpace:
        """Back-to-back slots of `slot_bytes` over all of `tensor`."""
        return PageSpace(tensor, slot_bytes, slot_bytes, tensor.numel() // slot_bytes)

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    def address(self, slot: int, offset: int = 0) -> int:
        return self.tensor.data_ptr() + self.offset + self.stride * slot + offset

    def rows(self, offset: int = 0, nbytes: int | None = None) -> torch.Tensor:
        """A strided [num_slots, nbytes] view of the bytes at `offset` in every slot."""
        nbytes = self.size - offset if nbytes is None else nbytes
        base = self.tensor.storage_offset()
        return self.tensor.as_strided((self.num_slots, nbytes), (self.stride, 1), base + self.offset + offset)


@dataclass(frozen=True)
class CopyOp:
    src: PageSpace
    dst: PageSpace
    src_slots: tuple[int, ...]
    dst_slots: tuple[int, ...]
    nbytes: int
    src_offset: int = 0
    dst_offset: int = 0

    def __post_init__(self) -> None:
        if len(self.src_slots) != len(self.dst_slots):
            raise LogicError("a copy needs as many source as destination slots")
        if self.src_offset + self.nbytes > self.src.size or self.dst_offset + self.nbytes > self.dst.size:
            raise LogicError("a copy chunk leaves its slot")
        for slots, space in ((self.src_slots, self.src), (self.dst_slots, self.dst)):
            if slots and (min(slots) < 0 or max(slots) >= space.num_slots):
                raise LogicError(f"slot outside [0, {space.num_slots}) in a copy")

    @property
    def num_bytes(self) -> int:
        return self.nbytes * len(self.src_slots)


class TransferBackend(Protocol):
    """Moves batches of page copies. All backends must produce identical bytes.

    `copy(ops)` = `launch(prepare(ops))`: the work is ordered after what `stream` (None: the current
    stream) already holds, and `stream`'s later work is ordered after it, except that a CUDA
    backend's save may still be carrying bytes to the host (the GPU pages may be reused, the host
    rows not yet read): `join(stream)` orders `stream` after those too, and `synchronize` waits until
    everything has landed. Destination slots within one op are distinct.
    """

    name: str

    def copy(self, ops: Sequence[CopyOp], stream: torch.cuda.Stream | None = None) -> None: ...

    def prepare(self, ops: Sequence[CopyOp]) -> object:
        """Host-side work (descriptor tables), so that `launch` can be timed or repeated alone."""

    def prepare_layers(self, layers: Sequence[Sequence[CopyOp]]) -> list[object]:
        """`[prepare(ops) for ops in layers]`: one prepared batch per layer of a layer-by-layer
        pass. A backend may build it faster where every layer's ops are the first layer's at
        other offsets inside the same slots (`same_but_offsets`): what each launches is the same.
        Launch them in layer order (a layer's copies may rely on the layer before having been
        launched just before them), each at most once after the layer before."""

    def launch(self, prepared: object, stream: torch.cuda.Stream | None = None) -> None: ...

    def synchronize(self, stream: torch.cuda.Stream | None = None) -> None: ...

    def join(self, stream: torch.cuda.Stream | None = None) -> None: ...


def same_but_offsets(first: Sequence[CopyOp], other: Sequence[CopyOp]) -> bool:
    """Whether `other` copies what `first` does (same spaces, slots and sizes, op by op) at other
    offsets inside the slots: one layer's chunk of a batch of pages against another's."""
    return len(first) == len(other) and all(
        _same_space(a.src, b.src) and _same_space(a.dst, b.dst) and a.nbytes == b.nbytes
        and a.src_slots == b.src_slots and a.dst_slots == b.dst_slots for a, b in zip(first, other, strict=True))


def _same_space(a: PageSpace, b: PageSpace) -> bool:
    return a is b or (a.tensor is b.tensor and (a.stride, a.size, a.num_slots, a.offset)
                      == (b.stride, b.size, b.num_slots, b.offset))


def layer_shifts(layers: Sequence[Sequence[CopyOp]]) -> list[list[tuple[int, int]]] | None:
    """Per layer, per op: (src, dst) byte shifts from the first layer's op, where every layer is
    the first at other offsets (`same_but_offsets`); None otherwise."""
    if not layers or not all(same_but_offsets(layers[0], ops) for ops in layers[1:]):
        return None
    return [[(b.src_offset - a.src_offset, b.dst_offset - a.dst_offset) for a, b in zip(layers[0], ops, strict=True)]
            for ops in layers]
