"""kvtool's reference vLLM connector (`kvtool-host`): whole blocks in host memory, keyed by vLLM's
own block hashes, written against vLLM 0.32.0's `KVConnectorBase_V1` and `SupportsHMA`.

It is the connector every vLLM scenario passes with, and the base of the planted buggy ones in
kvtool's tests. Options (`kv_connector_extra_config`):

- `async_load` (false): loads are asynchronous: the request waits in `WAITING_FOR_REMOTE_KVS`
  until the worker reports it in `finished_recving`;
- `async_save` (false): a finished request's blocks are saved after it finished:
  `request_finished` answers `delay_free` and the worker reports the id in `finished_sending`
  (with several KV cache groups, blocks are saved as they complete all the same, since a
  sliding-window group's early blocks are freed before the request ends: only the hold and the
  report are deferred);
- `defer_asks` (0): the first N asks of each request answer None (ask again next step);
- `fail_loads` (0): the first N loads leave their last block unloaded and report it in
  `get_block_ids_with_load_errors`;
- `store` ("default"): the name of the in-process store (scheduler and workers share it).

Saves (not `async_save`) are whole blocks the step completed, copied in `wait_for_save`. The
scheduler side keeps each request's block ids from `SchedulerOutput` as the model runner does
(`BlockTables`: a resumed request's list replaces its old one). A block is offered once every
worker holds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvtool.vllm_compat.block_tables import BlockTables
from kvtool.vllm_compat.fingerprints import NULL_BLOCK
from kvtool.vllm_compat.worker_rank import current_worker

Blocks = tuple[int, ...]
"""One block ordinal's block id in each KV cache group."""


@dataclass(frozen=True)
class Transfer:
    request_id: str
    blocks: tuple[tuple[Blocks, bytes], ...]
    """(block id per group, block hash) of each block moved."""


@dataclass
class HostMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    async_loads: set[str] = field(default_factory=set)
    async_saves: set[str] = field(default_factory=set)


@dataclass
class BlockStore:
    """Blocks by (worker, hash): each layer's bytes of the block, as the worker's tensors hold them."""

    blocks: dict[tuple[int, bytes], dict[str, torch.Tensor]] = field(default_factory=dict)
    workers: set[int] = field(default_factory=set)

    def has(self, block_hash: bytes) -> bool:
        return bool(self.workers) and all((w, block_hash) in self.blocks for w in self.workers)


_STORES: dict[str, BlockStore] = {}


def store_named(name: str) -> BlockStore:
    return _STORES.setdefault(name, BlockStore())


class KvtoolHostConnector(KVConnectorBase_V1, SupportsHMA):
    """Both roles, as vLLM builds a connector: the scheduler side or the worker side by `role`."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self.options = {"async_load": bool(extra.get("async_load", False)),
                        "async_save": bool(extra.get("async_save", False)),
                        "defer_asks": int(extra.get("defer_asks", 0)), "fail_loads": int(extra.get("fail_loads", 0))}
        self.store = store_named(str(extra.get("store", "default")))
        self.block_size = vllm_config.cache_config.block_size
        self.rank = current_worker()
        self.groups = [list(g.layer_names) for g in kv_cache_config.kv_cache_groups] if kv_cache_config else []
        self.tables = BlockTables()
        self.requests: dict[str, Any] = {}
        self.asks: dict[str, int] = {}
        self.asked_at: dict[str, int] = {}
        self.meta = HostMetadata()
        self.tensors: dict[str, torch.Tensor] = {}
        self.loads_done = 0
        self.load_errors: set[int] = set()
        self.recved: set[str] = set()
        self.failed: set[str] = set()
        self.sent: set[str] = set()

    # ---- scheduler side ----

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        self.requests[request.request_id] = request
        self.asks[request.request_id] = self.asks.get(request.request_id, 0) + 1
        if self.asks[request.request_id] <= self.options["defer_asks"]:
            return None, False
        self.asked_at[request.request_id] = num_computed_tokens
        hit = self.stored_prefix(request) * self.block_size
        if hit <= num_computed_tokens:
            return 0, False
        return hit - num_computed_tokens, bool(self.options["async_load"])

    def stored_prefix(self, request: Any) -> int:
        """Whole blocks from the first that every worker holds, short of the prompt's last token."""
        limit = (request.num_prompt_tokens - 1) // self.block_size
        count = 0
        while count < min(limit, len(request.block_hashes)) and self.store.has(request.block_hashes[count]):
            count += 1
        return count

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        first = self.asked_at[request.request_id] // self.block_size
        last = (self.asked_at[request.request_id] + num_external_tokens) // self.block_size
        ids = blocks.get_block_ids()
        pairs = tuple((tuple(group[b] for group in ids), request.block_hashes[b]) for b in range(first, last))
        self.meta.loads.append(Transfer(request.request_id, pairs))
        if self.options["async_load"]:
            self.meta.async_loads.add(request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        eager = not self.options["async_save"] or len(self.groups) > 1
        for s in self.tables.update(scheduler_output):
            request = self.requests.get(s.request_id)
            if request is not None and eager:
                self.add_save(request, s.start, s.end, s.blocks)
        meta, self.meta = self.meta, HostMetadata()
        return meta

    def add_save(self, request: Any, start: int, end: int, blocks: tuple[tuple[int, ...], ...]) -> None:
        """The blocks that [start, end) completes, not yet stored, saved this step."""
        ordinals = range(start // self.block_size, min(end // self.block_size, len(request.block_hashes)))
        pairs = tuple((tuple(group[b] for group in blocks), request.block_hashes[b]) for b in ordinals
                      if not self.store.has(request.block_hashes[b]))
        if pairs:
            self.meta.saves.append(Transfer(request.request_id, pairs))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        self.requests.pop(request.request_id, None)
        self.asks.pop(request.request_id, None)
        self.asked_at.pop(request.request_id, None)
        if not self.options["async_save"]:
            return False, None
        blocks = tuple(tuple(group) for group in block_ids)
        before = len(self.meta.saves)
        self.add_save(request, 0, request.num_computed_tokens, blocks)
        if len(self.meta.saves) == before:
            if len(self.groups) == 1:
                return False, None
            self.meta.saves.append(Transfer(request.request_id, ()))   # nothing left: still held, then sent
        self.meta.async_saves.add(request.request_id)
        return True, None

    # ---- worker side ----

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.tensors = kv_caches
        self.store.workers.add(self.rank)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HostMetadata)
        for transfer in meta.loads:
            asynchronous = transfer.request_id in meta.async_loads
            self.load(transfer, asynchronous)
            if asynchronous:
                self.recved.add(transfer.request_id)

    def load(self, transfer: Transfer, asynchronous: bool) -> None:
        """Every block of the transfer, but where a failure is due (`fail_loads`): the last block
        reported in `get_block_ids_with_load_errors`, or, with several KV cache groups (whose
        block ids vLLM cannot map back), the whole asynchronous load in `failed_recving` (vLLM
        0.32.0 has no failure path for a synchronous load there: none is injected)."""
        pairs = list(transfer.blocks)
        several_groups = len(self.groups) > 1
        self.loads_done += not several_groups or asynchronous
        if pairs and self.loads_done <= self.options["fail_loads"] and (not several_groups or asynchronous):
            if several_groups:
                self.failed.add(transfer.request_id)
                return
            failed, _ = pairs.pop()
            self.load_errors.update(b for b in failed if b != NULL_BLOCK)
        for blocks, block_hash in pairs:
            self.copy_block(blocks, block_hash, into_pages=True)

    def copy_block(self, blocks: Blocks, block_hash: bytes, into_pages: bool) -> None:
        """One block's bytes in every layer, from the store into the pages (a group's null block
        skipped: outside its window) or back (only a block every group holds is stored whole)."""
        if into_pages:
            saved = self.store.blocks[(self.rank, block_hash)]
            for group, names in enumerate(self.groups):
                for name in names if blocks[group] != NULL_BLOCK else ():
                    self.tensors[name][blocks[group]].copy_(saved[name])
        elif NULL_BLOCK not in blocks:
            self.store.blocks[(self.rank, block_hash)] = {
                name: self.tensors[name][blocks[group]].clone()
                for group, names in enumerate(self.groups) for name in names}

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HostMetadata)
        for transfer in meta.saves:
            self.save(transfer)
            if transfer.request_id in meta.async_saves:
                self.sent.add(transfer.request_id)

    def save(self, transfer: Transfer) -> None:
        for blocks, block_hash in transfer.blocks:
            self.copy_block(blocks, block_hash, into_pages=False)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sent, self.sent = self.sent, set()
        recved, self.recved = self.recved, set()
        return sent or None, recved or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sent, recved = self.get_finished(finished_req_ids)
        failed, self.failed = self.failed, set()
        return KVConnectorTransferResults(set(sent or ()), set(recved or ()) | failed, failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors
