"""The worker half shared by the block-store connectors: when copies happen, per mode.

- `sync`: loads in `start_load_kv`, saves in `wait_for_save`.
- `layerwise`: each layer's share of the loads in `wait_for_layer_load`, of the saves in
  `save_kv_layer` (sub-slot chunks: one layer's buffers inside each page).
- `async`: loads on a background thread, and saves of finished requests too (queued before the
  loads of the same pass, on one thread, so a load never reads an entry before it is written);
  `get_finished` reports a request once its copies have landed, and only requests it was given.

Subclasses say how a batch of page transfers moves between the cache and their store.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvtool.connector.api import HostStream, KvCacheConnectorWorker
from kvtool.connector.llm_args import LlmArgs
from kvtool.connector.pool_tensor import layout_of_pool_tensor
from kvtool.connectors.metadata import PageTransfer, StoreMetadata
from kvtool.connectors.store_mode import StoreMode, store_mode
from kvtool.errors import LogicError
from kvtool.manager.layout import KvCacheLayout
from kvtool.transfer import TransferBackend, get_backend
from kvtool.transfer.api import CopyOp, PageSpace
from kvtool.transfer.registry import AUTO, best_backend


class BlockStoreWorker(KvCacheConnectorWorker):
    def __init__(self, llm_args: LlmArgs) -> None:
        super().__init__(llm_args)
        self.mode = store_mode(llm_args.connector_options)
        self.backend_name = llm_args.connector_options.get("backend", AUTO)
        self.layout: KvCacheLayout | None = None
        self.backend: TransferBackend | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._loading: dict[int, Future] = {}
        self._saving: dict[int, Future] = {}
        self._given_loads: set[int] = set()
        self._given_saves: set[int] = set()
        self._prefix_loading: dict[int, Future] = {}
        self._prefix_loaded: list[int] = []
        """Reservation ids of synchronous prefix loads started, not reported yet."""
        self._staged_batch: tuple | None = None

    def register_kv_caches(self, kv_cache_tensor: torch.Tensor) -> None:
        """TensorRT-LLM's V1: the one pool tensor, served as the one-region layout it is."""
        self.register_kv_cache_layout(layout_of_pool_tensor(kv_cache_tensor,
                                                            self._llm_args.kv_cache_config.tokens_per_block,
                                                            self._llm_args.model))

    def register_kv_cache_layout(self, layout: KvCacheLayout) -> None:
        self.layout = layout
        if self.backend_name == AUTO:     # a layout without memory (block fidelity) moves no bytes: torch
            storage = layout.group(0).regions[0].storage
            self.backend_name = best_backend(storage.device if storage is not None else torch.device("cpu"))
        self.backend = get_backend(self.backend_name)
        self.open_store(layout)

    @property
    def registered_layout(self) -> KvCacheLayout:
        """`layout`, which `register_kv_cache_layout` sets before any copy (LogicError before it)."""
        if self.layout is None:
            raise LogicError(f"{type(self).__name__}: no KV cache layout registered yet")
        return self.layout

    @property
    def transfer_backend(self) -> TransferBackend:
        """`backend`, which `register_kv_cache_layout` sets before any copy (LogicError before it)."""
        if self.backend is None:
            raise LogicError(f"{type(self).__name__}: no transfer backend before the layout is registered")
        return self.backend

    # ---- per store ---------------------------------------------------------------------------
    @abstractmethod
    def open_store(self, layout: KvCacheLayout) -> None:
        """Set up the store for this layout."""

    @abstractmethod
    def load(self, transfers: Sequence[PageTransfer], layer_id: int | None = None) -> None:
        """Copy store -> pages (only `layer_id`'s buffers when given); landed on return."""

    @abstractmethod
    def save(self, transfers: Sequence[PageTransfer], layer_id: int | None = None) -> None:
        """Copy pages -> store (only `layer_id`'s buffers when given); the pages may be reused on return."""

    # ---- hooks -------------------------------------------------------------------------------
    @property
    def meta(self) -> StoreMetadata:
        return self._metadata if isinstance(self._metadata, StoreMetadata) else StoreMetadata()

    def start_load_kv(self, stream: torch.cuda.Stream | HostStream) -> None:
        meta = self.meta
        if meta.loads and self.mode is not StoreMode.LAYERWISE:
            self._wait_for_background_saves()
            self.load(meta.loads)
        self._prefix_loaded += meta.prefix_loads   # landed by the time the pass is over (layerwise: per layer)
        self._submit(self._loading, False, meta.async_loads, stream)
        self._submit(self._prefix_loading, False, meta.async_prefix_loads, stream)

    def wait_for_layer_load(self, layer_idx: int, stream: torch.cuda.Stream | HostStream) -> None:
        if self.mode is StoreMode.LAYERWISE and self.meta.loads:
            self._wait_for_background_saves()
            self.load(self.meta.loads, layer_id=layer_idx)

    def _wait_for_background_saves(self) -> None:
        """A synchronous load must not overtake a background save of the entries it reads."""
        for future in list(self._saving.values()):
            future.exception()

    def save_kv_layer(self, layer_idx: int, stream: torch.cuda.Stream | HostStream) -> None:
        if self.mode is StoreMode.LAYERWISE and self.meta.saves:
            self.save(self.meta.saves, layer_id=layer_idx)

    def wait_for_save(self, stream: torch.cuda.Stream | HostStream) -> None:
        """The pass's synchronous saves, then its background ones (pages the runtime keeps until
        `get_finished` reports the request: the request runs on, or `request_finished` answered
        True). The background thread runs in order, so a request's newest save landing means
        all of its saves landed."""
        meta = self.meta
        if meta.saves and self.mode is not StoreMode.LAYERWISE:
            self.save(meta.saves)
        self._submit(self._saving, True, meta.async_saves, stream)

    def _submit(self, futures: dict[int, Future], to_store: bool, by_request: dict[int, list[PageTransfer]],
                stream: torch.cuda.Stream | HostStream | None) -> None:
        """One background copy for every request of the pass (one batch per pass and direction,
        as the synchronous path): each request's future is that batch's, so it is reported once
        the whole batch has landed, and a failed batch fails each of its requests."""
        if by_request:
            future = self.start_background([t for transfers in by_request.values() for t in transfers], to_store,
                                           stream)
            futures.update(dict.fromkeys(by_request, future))

    def start_background(self, transfers: list[PageTransfer], to_store: bool,
                         stream: torch.cuda.Stream | HostStream | None) -> Future:
        """Start one background batch (`save` when `to_store`, else `load`) after the work
        `stream` holds; its future is done once the bytes have landed, and raises what the copy
        raised. Here: on the store's one thread, in submission order (a save is read from the
        pages once the forward stream is synchronised)."""
        if to_store and stream is not None:
            stream.synchronize()   # the background thread reads what this pass's kernels wrote
        return self._background().submit(self.save if to_store else self.load, transfers)

    def get_finished(self, finished_gen_req_ids: list[int],
                     started_loading_req_ids: list[int]) -> tuple[list[int], list[int]]:
        self._given_saves.update(finished_gen_req_ids)
        self._given_loads.update(started_loading_req_ids)
        # Every save of a request was submitted by the time its id is given (in the passes before
        # request_finished); one whose pass failed before wait_for_save has nothing in flight. So was
        # every load (in start_load_kv, before this call): a request the runtime waits for with
        # nothing in flight had nothing honoured (`main`'s V2 parks an asynchronous answer even so).
        loaded = self._done(self._loading, self._given_loads, nothing_pending_is_done=True)
        # A request that ended while its background load ran is reported once that load landed
        # too (its scheduler kept the pages for it: `request_finished`).
        loading = {rid for rid in self._given_saves if rid in self._loading and not self._loading[rid].done()}
        self._given_saves -= loading
        saved = self._done(self._saving, self._given_saves, nothing_pending_is_done=True)
        self._given_saves |= loading
        for rid in saved:
            load = self._loading.pop(rid, None)
            if load is not None:
                load.result()
        return saved, loaded

    def _finished_prefix_loads(self) -> list[int]:
        """`get_finished_prefix_loads` (`PrefixReservingWorker`): prefix loads landed here, the
        synchronous ones of passes that ran, the background ones done."""
        done, self._prefix_loaded = self._prefix_loaded, []
        return done + self._done(self._prefix_loading, set(self._prefix_loading))

    def _done(self, futures: dict[int, Future], given: set[int], nothing_pending_is_done: bool = False) -> list[int]:
        done = [rid for rid in given if (rid in futures and futures[rid].done())
                or (nothing_pending_is_done and rid not in futures)]
        for rid in done:
            given.discard(rid)
            future = futures.pop(rid, None)
            if future is not None:
                future.result()  # a failed copy raises here, in get_finished
        return done

    def _background(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtool-store")
        return self._executor

    # ---- helpers for subclasses ----------------------------------------------------------------
    def page_ops(self, transfers: Sequence[PageTransfer], store: dict[int, PageSpace], store_slots: list[int],
                 to_store: bool, layer_id: int | None) -> list[CopyOp]:
        """One copy per (layer group, region): pages <-> `store[group]` rows `store_slots[i]`."""
        return self.layer_page_ops(transfers, store, store_slots, to_store, [layer_id])[0]

    def layer_page_ops(self, transfers: Sequence[PageTransfer], store: dict[int, PageSpace],
                       store_slots: list[int], to_store: bool, layer_ids: Sequence[int | None]) -> list[list[CopyOp]]:
        """`page_ops` for each of `layer_ids` (None: whole pages), the transfers grouped once:
        every request's pages of a group in one op per region, the same slot tuples in every layer."""
        by_group: dict[int, list[int]] = {}
        for i, transfer in enumerate(transfers):
            by_group.setdefault(transfer.layer_group_id, []).append(i)
        grouped = [(group_id, tuple(transfers[i].page for i in indices), tuple(store_slots[i] for i in indices))
                   for group_id, indices in by_group.items()]
        return [self._group_ops(grouped, store, to_store, layer_id) for layer_id in layer_ids]

    def _group_ops(self, grouped: list[tuple[int, tuple[int, ...], tuple[int, ...]]], store: dict[int, PageSpace],
                   to_store: bool, layer_id: int | None) -> list[CopyOp]:
        ops = []
        for group_id, pages, rows in grouped:
            entry_offset = 0
            for region in self.registered_layout.group(group_id).regions:
                chunk = _layer_chunk(region, layer_id)
                if chunk is not None:
                    offset, nbytes = chunk
                    cache = PageSpace.of_region(region)
                    if to_store:
                        ops.append(CopyOp(cache, store[group_id], pages, rows, nbytes, offset, entry_offset + offset))
                    else:
                        ops.append(CopyOp(store[group_id], cache, rows, pages, nbytes, entry_offset + offset, offset))
                entry_offset += region.size
        return ops

    def staging_rows(self, transfers: Sequence[PageTransfer]) -> tuple[dict[int, PageSpace], list[int]]:
        """A CPU row per transfer, one buffer per layer group: where a store that hands out bytes
        (files, a server) puts them on their way to or from the pages; pinned for a CUDA backend,
        which reaches host memory only when it is pinned (torch's pinned cache reuses the buffers)."""
        counts: dict[int, int] = {}
        rows = []
        for t in transfers:
            rows.append(counts.get(t.layer_group_id, 0))
            counts[t.layer_group_id] = rows[-1] + 1
        staging = {}
        pin = self.backend is not None and self.backend.name != "torch"
        for g, n in counts.items():
            size = self.registered_layout.group(g).bytes_per_page
            staging[g] = PageSpace.contiguous(torch.empty(n * size, dtype=torch.uint8, pin_memory=pin), size)
        return staging, rows

    def load_payloads(self, transfers: Sequence[PageTransfer], layer_id: int | None,
                      read: Callable[[Sequence[PageTransfer]], list]) -> None:
        """Copy the pages of `transfers` in from the bytes `read(transfers)` returns (one per
        transfer); read once per batch, so the layer-by-layer loads of one pass reuse them."""
        if self._staged_batch is None or self._staged_batch[0] is not transfers:
            self._staged_batch = (transfers, *self.staged_pages(transfers, read(transfers)))
        _, staging, rows = self._staged_batch
        if layer_id is None:
            self._staged_batch = None    # a whole-page load is the batch's only one: free its staging
        self.transfer_backend.copy(self.page_ops(transfers, staging, rows, to_store=False, layer_id=layer_id))
        self.transfer_backend.synchronize()

    def staged_pages(self, transfers: Sequence[PageTransfer], payloads: Sequence) -> tuple[dict[int, PageSpace],
                                                                                          list[int]]:
        """Staging rows holding `payloads[i]` (bytes-like, one page each) for `transfers[i]`."""
        staging, rows = self.staging_rows(transfers)
        for i, t in enumerate(transfers):
            group = staging[t.layer_group_id]
            group.tensor[rows[i] * group.stride:(rows[i] + 1) * group.stride] = torch.frombuffer(
                bytearray(payloads[i]), dtype=torch.uint8)
        return staging, rows

    def saved_payloads(self, transfers: Sequence[PageTransfer]) -> list[bytes]:
        """The pages of `transfers` as bytes, one per transfer, copied out through staging."""
        staging, rows = self.staging_rows(transfers)
        self.transfer_backend.copy(self.page_ops(transfers, staging, rows, to_store=True, layer_id=None))
        self.transfer_backend.synchronize()
        payloads = []
        for i, t in enumerate(transfers):
            group = staging[t.layer_group_id]
            payloads.append(group.tensor[rows[i] * group.stride:(rows[i] + 1) * group.stride].numpy().tobytes())
        return payloads



class PrefixReservingWorker(BlockStoreWorker):
    """The worker half of `store_scheduler.PrefixReservingScheduler`: reports confirmed prefix loads."""

    def get_finished_prefix_loads(self) -> list[int]:
        return self._finished_prefix_loads()


def _layer_chunk(region, layer_id: int | None) -> tuple[int, int] | None:
    """(offset, bytes) of `layer_id`'s buffers inside one page of `region`; the whole page for None."""
    if layer_id is None:
        return 0, region.size
    indices = [i for i, b in enumerate(region.buffers) if b.layer_id == layer_id]
    if not indices:
        return None
    return indices[0] * region.buffer_bytes, len(indices) * region.buffer_bytes
