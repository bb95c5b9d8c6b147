"""Memory for one transfer case: a KV region laid out as the model's layout says, a host store, and
the page copies a connector would issue for a batch (random pages, consecutive store slots)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtool.errors import InputError, LogicError
from kvtool.manager import KvCacheManagerConfig, compute_layout
from kvtool.manager.storage import require_memory
from kvtool.models import load_model
from kvtool.transfer.api import CopyOp, PageSpace
from kvtool.types import TextEnum

GRANULARITIES = ("slot", "layer")
class Direction(TextEnum):
    SAVE = "save"         # GPU pages -> host store rows
    LOAD = "load"         # host store rows -> GPU pages
    BOTH = "both"         # a save and a load at once, on two streams
    GATHER = "gather"     # GPU pages -> contiguous GPU staging


DIRECTIONS: tuple[Direction, ...] = tuple(Direction)
MAX_REGION_BYTES = 8 << 30


@dataclass(frozen=True)
class Geometry:
    """Where one chunk of a page lives: `nbytes` at `offset` inside slots of `stride` bytes."""

    model: str
    tokens_per_block: int
    granularity: str
    stride: int
    offset: int
    nbytes: int


def geometry(model: str, tokens_per_block: int, granularity: str) -> Geometry:
    """Layer group 0's first region: the whole page (`slot`) or layer 0's buffers in it (`layer`)."""
    if granularity not in GRANULARITIES:
        raise InputError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
    layout = compute_layout(KvCacheManagerConfig(load_model(model), tokens_per_block, num_slots=1))
    region = layout.group(0).regions[0]
    if granularity == "slot":
        return Geometry(model, tokens_per_block, granularity, region.stride, 0, region.size)
    first = region.buffers[0].layer_id
    count = sum(b.layer_id == first for b in region.buffers)
    return Geometry(model, tokens_per_block, granularity, region.stride, 0, count * region.buffer_bytes)


@dataclass
class Workspace:
    geometry: Geometry
    region: PageSpace
    store: PageSpace
    staging: PageSpace
    num_pages: int
    pages: tuple[int, ...]

    @property
    def batch_bytes(self) -> int:
        return self.num_pages * self.geometry.nbytes

    def ops(self, direction: Direction) -> list[CopyOp]:
        """The one copy of a single direction (BOTH is a save and a load: ask for each)."""
        g = self.geometry
        rows = tuple(range(self.num_pages))
        if direction is Direction.SAVE:
            return [CopyOp(self.region, self.store, self.pages, rows, g.nbytes, g.offset, 0)]
        if direction is Direction.LOAD:
            return [CopyOp(self.store, self.region, rows, self.pages, g.nbytes, 0, g.offset)]
        if direction is Direction.GATHER:
            return [CopyOp(self.region, self.staging, self.pages, rows, g.nbytes, g.offset, 0)]
        raise LogicError(f"{direction} is not a single copy direction")

    def poison(self, direction: Direction) -> None:
        target = {Direction.SAVE: self.store, Direction.LOAD: self.region, Direction.GATHER: self.staging}[direction]
        target.tensor.fill_(0xA5)

    def verify(self, direction: Direction) -> bool:
        """The destination holds exactly the source's bytes, for every page of the batch."""
        (op,) = self.ops(direction)
        index_src = torch.tensor(op.src_slots, device=op.src.device)
        index_dst = torch.tensor(op.dst_slots, device=op.dst.device)
        moved = op.src.rows(op.src_offset, op.nbytes).index_select(0, index_src).cpu()
        landed = op.dst.rows(op.dst_offset, op.nbytes).index_select(0, index_dst).cpu()
        return bool(torch.equal(moved, landed))


def make_workspace(g: Geometry, batch_bytes: int, device: torch.device, seed: int = 0) -> Workspace:
    """A region, a host store and a staging buffer for batches of `batch_bytes`; OutOfMemoryError
    (before allocating) when they cannot fit."""
    num_pages = max(1, batch_bytes // g.nbytes)
    num_slots = max(2 * num_pages, num_pages + 16)
    if num_slots * g.stride > MAX_REGION_BYTES:
        num_slots = max(num_pages, MAX_REGION_BYTES // g.stride)
    require_memory(num_slots * g.stride + num_pages * g.nbytes, device)
    require_memory(2 * num_pages * g.nbytes, torch.device("cpu"))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    region = _random(num_slots * g.stride, device, seed)
    pin = device.type == "cuda"
    store = torch.randint(0, 256, (num_pages * g.nbytes,), dtype=torch.uint8, generator=gen)
    store = store.pin_memory() if pin else store
    staging = torch.empty(num_pages * g.nbytes, dtype=torch.uint8, device=device)
    pages = tuple(torch.randperm(num_slots, generator=gen)[:num_pages].tolist())
    return Workspace(g, PageSpace(region, g.stride, g.stride, num_slots), PageSpace.contiguous(store, g.nbytes),
                     PageSpace.contiguous(staging, g.nbytes), num_pages, pages)


def _random(num_bytes: int, device: torch.device, seed: int) -> torch.Tensor:
    """Random bytes (never measure on zeros), generated where they live."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, device=device, generator=gen)
