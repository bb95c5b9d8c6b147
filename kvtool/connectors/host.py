"""`host`: a store of full blocks in host memory (pinned when CUDA exists), LRU, fixed capacity.

The scheduler owns the index (which entry sits in which store slot, LRU order, pins), so the
worker only moves bytes: one batched copy per layer group and region, never a loop per page.
`layerwise`: every request's pages of a layer leave in one launch per layer and direction
(`layer_copies`), a save after the layer's compute and a load before it, on a stream of the
worker's own where the pages are on a GPU. `async` on a GPU: each pass's batch is launched on that
stream after the forward's work, and reported once an event behind it has passed (no thread).
Options (llm_args.connector_options): `capacity` (bytes, e.g. `1GiB`; default 256MiB), `eviction` (`lru`,
`lfu`: `slot_index`), `mode`
(`sync`, `async`, `layerwise`), `backend` (a transfer backend name; default `auto`: `staged` for GPU
pages where PyCUDA runs, else `torch`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import ClassVar

import numpy as np
import torch

from kvtool.connector.api import HostStream
from kvtool.connector.introspection import Introspection
from kvtool.connector.llm_args import LlmArgs
from kvtool.connector.options import ConnectorOption
from kvtool.connectors.layer_copies import Landed, LayerBatches, SideStream
from kvtool.connectors.metadata import PageTransfer, StoreMetadata
from kvtool.connectors.slot_index import EVICTION_POLICIES, SlotIndex, slot_index
from kvtool.connectors.store_mode import StoreMode
from kvtool.connectors.store_scheduler import STORE_OPTIONS, BlockStoreScheduler, PrefixReservingScheduler
from kvtool.connectors.store_worker import BlockStoreWorker, PrefixReservingWorker
from kvtool.errors import InputError
from kvtool.manager.layout import KvCacheLayout
from kvtool.transfer.api import PageSpace
from kvtool.units import parse_size

DEFAULT_CAPACITY = "256MiB"
DEFAULT_SYNC_HEAD = "8"
SYNC_HEAD_OPTION = ConnectorOption("sync_head", "synchronous copies on a GPU: launch the first 1/N of a pass's "
                                   "batch before preparing the rest, so the link starts while the host works "
                                   "(0: the batch in one launch)", DEFAULT_SYNC_HEAD, check=lambda v: _divisor(v))
DEFAULT_EVICTION = "lru"
EVICTION_OPTION = ConnectorOption("eviction", "which block goes when the tier is full: lru (least recently "
                                  "used) or lfu (least often used, ties least recent)", DEFAULT_EVICTION,
                                  tuple(EVICTION_POLICIES))


def entries_per_group(llm_args: LlmArgs) -> int:
    """Store slots per layer group: every group holds as many blocks as the capacity allows."""
    capacity = parse_size(llm_args.connector_options.get("capacity", DEFAULT_CAPACITY))
    per_block = sum(g.bytes_per_page for g in llm_args.layer_groups)
    if capacity < per_block:
        raise InputError(f"host store capacity {capacity} bytes is below one block ({per_block} bytes)")
    return capacity // per_block


def _divisor(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"sync_head must be 0 or more, got {value}")
    return value


def head_and_rest(transfers: Sequence[PageTransfer], divisor: int) -> list[Sequence[PageTransfer]]:
    """`transfers` as the launches of a synchronous copy: the first 1/`divisor` (at least one) and
    the rest, or all at once when `divisor` is 0 or the batch is too small to split."""
    head = len(transfers) // divisor if divisor else 0
    return [transfers[:head], transfers[head:]] if head else [transfers]


def zeroed_host_bytes(nbytes: int, pin: bool) -> torch.Tensor:
    """`nbytes` zero bytes in host memory (zeros, so a slot read before any save shows as such).
    Pinned: zeroed now (page-locking touches every page anyway, and pinned blocks are reused).
    Else through calloc (numpy): the OS hands out zeroed pages when they are first touched, so a
    store costs nothing until it is used; zeroing 256 MiB took 56 ms on this project's CPU, most
    of a validate scenario's time."""
    if pin:
        return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8))


class HostConnectorScheduler(BlockStoreScheduler):
    kvtool_options: ClassVar[tuple[ConnectorOption, ...]] = STORE_OPTIONS + (
        ConnectorOption("capacity", "host memory for stored blocks, e.g. 1GiB", DEFAULT_CAPACITY, check=parse_size),
        EVICTION_OPTION, SYNC_HEAD_OPTION,
    )

    def __init__(self, llm_args: LlmArgs) -> None:
        super().__init__(llm_args)
        size = entries_per_group(llm_args)
        policy = llm_args.connector_options.get("eviction", DEFAULT_EVICTION)
        self.indexes: dict[int, SlotIndex] = {g.layer_group_id: slot_index(policy, size) for g in self.groups}

    def lookup(self, key: bytes, layer_group_id: int) -> tuple[int, int] | None:
        slot = self.indexes[layer_group_id].lookup(key)
        return None if slot is None else (layer_group_id, slot)

    def contains(self, key: bytes, layer_group_id: int) -> bool:
        return key in self.indexes[layer_group_id]

    def reserve(self, key: bytes, layer_group_id: int) -> tuple[int, int] | None:
        slot = self.indexes[layer_group_id].reserve(key)
        return None if slot is None else (layer_group_id, slot)

    def discard(self, key: bytes, layer_group_id: int, location: tuple[int, int]) -> None:
        self.indexes[layer_group_id].discard(key)

    def pin(self, location: tuple[int, int]) -> None:
        self.indexes[location[0]].pin(location[1])

    def unpin(self, location: tuple[int, int]) -> None:
        self.indexes[location[0]].unpin(location[1])

    def kvtool_introspection(self) -> Introspection:
        return replace(super().kvtool_introspection(), pinned_entries=sum(i.num_pinned for i in self.indexes.values()),
                       evicted_entries=sum(i.num_evictions for i in self.indexes.values()))


class HostConnectorWorker(BlockStoreWorker):
    def __init__(self, llm_args: LlmArgs) -> None:
        super().__init__(llm_args)
        self._side = SideStream(False)
        self._sync_head = _divisor(llm_args.connector_options.get("sync_head", DEFAULT_SYNC_HEAD))
        self._layer_loads: LayerBatches | None = None
        self._layer_saves: tuple[StoreMetadata, LayerBatches] | None = None
        """This pass's save plan, with the metadata it was built for."""

    def open_store(self, layout: KvCacheLayout) -> None:
        size = entries_per_group(self._llm_args)
        pin = torch.cuda.is_available()
        self.store: dict[int, PageSpace] = {
            g.layer_group_id: PageSpace.contiguous(zeroed_host_bytes(size * g.bytes_per_page, pin), g.bytes_per_page)
            for g in layout.layer_groups}
        storage = layout.group(0).regions[0].storage
        self._side = SideStream(storage is not None and storage.is_cuda)

    def commit_store(self) -> None:
        """Write every page of the store once (zeros), so that later copies pay no first-touch page
        faults (`zeroed_host_bytes`): what a benchmark times, and what a long-running engine's
        store is like once it has filled."""
        for space in self.store.values():
            space.tensor.zero_()

    def load(self, transfers: Sequence[PageTransfer], layer_id: int | None = None) -> None:
        self._copy(transfers, to_store=False, layer_id=layer_id)

    def save(self, transfers: Sequence[PageTransfer], layer_id: int | None = None) -> None:
        self._copy(transfers, to_store=True, layer_id=layer_id)

    def _copy(self, transfers: Sequence[PageTransfer], to_store: bool, layer_id: int | None) -> None:
        """One launch (on a GPU: a head, then the rest prepared while the head crosses), landed on return."""
        for part in head_and_rest(transfers, self._sync_head if self._side.stream is not None else 0):
            slots = [t.location[1] for t in part]
            self.transfer_backend.copy(self.page_ops(part, self.store, slots, to_store, layer_id))
        self.transfer_backend.synchronize()

    # ---- layerwise: one launch per layer and direction ------------------------------------------
    def start_load_kv(self, stream: torch.cuda.Stream | HostStream) -> None:
        super().start_load_kv(stream)
        self._layer_loads = None
        if self.mode is StoreMode.LAYERWISE and self.meta.loads:
            self._wait_for_background_saves()
            self._layer_loads = self._layer_batches(self.meta.loads, to_store=False)
            self._side.follow(stream)              # after the work that handed the pages out
            self._layer_loads.launch_all(self.transfer_backend, self._side)

    def wait_for_layer_load(self, layer_idx: int, stream: torch.cuda.Stream | HostStream) -> None:
        if self.mode is not StoreMode.LAYERWISE:
            super().wait_for_layer_load(layer_idx, stream)
        elif self._layer_loads is not None:
            self._layer_loads.wait(layer_idx, stream)

    def save_kv_layer(self, layer_idx: int, stream: torch.cuda.Stream | HostStream) -> None:
        if self.mode is not StoreMode.LAYERWISE or not self.meta.saves:
            return
        meta = self.meta
        if self._layer_saves is None or self._layer_saves[0] is not meta:
            self._layer_saves = (meta, self._layer_batches(meta.saves, to_store=True))
        self._side.follow(stream)                  # after this layer's compute
        self._layer_saves[1].launch(layer_idx, self.transfer_backend, self._side)

    def wait_for_save(self, stream: torch.cuda.Stream | HostStream) -> None:
        if self._layer_saves is not None:
            self._layer_saves = None
            self._side.drain(self.transfer_backend)         # every layer's bytes in the store
        self._layer_loads = None
        super().wait_for_save(stream)

    def _layer_batches(self, transfers: Sequence[PageTransfer], to_store: bool) -> LayerBatches:
        """Every layer's copies of `transfers`, prepared together (pages of all requests coalesced)."""
        layer_ids = sorted(layer for group in self.registered_layout.layer_groups for layer in group.layer_ids)
        slots = [t.location[1] for t in transfers]
        ops = self.layer_page_ops(transfers, self.store, slots, to_store, layer_ids)
        return LayerBatches.prepare(self.transfer_backend, layer_ids, ops)

    # ---- async on a GPU: launched on the side stream, reported by an event ----------------------
    def start_background(self, transfers: list[PageTransfer], to_store: bool,
                         stream: torch.cuda.Stream | HostStream | None):
        """A save on GPU pages: the batch launched on the worker's stream after the forward's
        work (no thread, no wait for the forward), done once an event behind its copies has
        passed. Loads stay on the store's thread: on one H100 they measured 0.82-0.86 of the link
        there against 0.69-0.83 on the stream, saves 0.67-0.80 there against 0.83-0.91
        (results/issue-56-link)."""
        if self._side.stream is None or not to_store:
            return super().start_background(transfers, to_store, stream)
        slots = [t.location[1] for t in transfers]
        prepared = self.transfer_backend.prepare(self.page_ops(transfers, self.store, slots, to_store, None))
        self._side.follow(stream)
        self._side.launch(self.transfer_backend, prepared)
        self.transfer_backend.join(self._side.stream)       # a staged save's copies to the host included
        return Landed(self._side.mark())


class ReservingHostScheduler(PrefixReservingScheduler, HostConnectorScheduler):
    """`host-reserve`: the host connector taking part in `main`'s V2 prefix reservations."""


class ReservingHostWorker(PrefixReservingWorker, HostConnectorWorker):
    pass
