"""The connector halves shared by remote tiers (`redis`, `mooncake`): a server that many engines
share, each saving its computed blocks and loading the prefixes any of them saved (keys, values and
failures: `remote_store`; the server's calls: its store class).

The ask→load window: a remote server may evict a block, expire it, lose it in a restart, or drop
the connection at any moment, and an offer is a promise. So the ask fetches what it offers: one
batched existence check finds the run of stored blocks, one batched read fetches every rank's value
of the planned entries into host staging, and each is verified (key, group, size, SHA-256) before
the offer is made. The load then copies from staging and cannot fail on the server. What does not check out is
a miss, and the ask plans again without it. Staged bytes are bounded by the `staging` option (an
offer is shortened to fit). Ranks: the scheduler fetches every rank's shard (the key names the
rank), and the metadata carries them to each rank's worker.

Saves: every block this engine computed is written (one batch per pass; a block loaded from the
store or found on the GPU is not computed, hence not written again). Checking first would cost a
round trip and protect nothing: a value is rewritten with the same bytes. A failed write is a lost
cache entry, counted and warned about, never a failed request.
A bounded store (`capacity`, `eviction`: `remote_store.StoreBound`) ranks the blocks an ask plans
(`secure`) and those rank 0 writes, and drops the lowest ranked past its capacity.
The `-index` variants are the same tiers for block fidelity: the same keys, asks and saves, but
each value is the block's header alone (no page bytes exist to store), and nothing is fetched or
copied.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kvtool.connector.introspection import Introspection
from kvtool.connector.llm_args import LlmArgs
from kvtool.connectors.metadata import PageTransfer
from kvtool.connectors.remote_store import DEFAULT_STAGING, Entry, RemoteBlockStore, StagedEntry
from kvtool.connectors.store_scheduler import BlockStoreScheduler
from kvtool.connectors.store_worker import BlockStoreWorker
from kvtool.manager.layout import KvCacheLayout
from kvtool.units import parse_size


class RemoteStoreScheduler(BlockStoreScheduler):
    store_class: type[RemoteBlockStore]

    def __init__(self, llm_args: LlmArgs) -> None:
        super().__init__(llm_args)
        self.store = self.store_class(llm_args, payloads=getattr(self, "kvtool_moves_bytes", True))
        self.staging_capacity = parse_size(llm_args.connector_options.get("staging", DEFAULT_STAGING))
        self.num_staged_bytes = 0
        self._block_bytes = llm_args.world_size * sum(g.bytes_per_page for g in self.groups)
        self._present: set[Entry] = set()
        """This ask's snapshot: entries rank 0's shard had when the ask began (less what vanished)."""

    def staging_room(self) -> int | None:
        """Blocks an offer may still stage (None: no bound)."""
        return max(self.staging_capacity - self.num_staged_bytes, 0) // self._block_bytes

    def begin_ask(self, keys: list[bytes], first: int) -> None:
        room = self.staging_room()
        candidates = keys[first:] if room is None else keys[first:first + room]
        wanted = [(key, g.layer_group_id) for key in candidates for g in self.groups]
        self._present = self.store.existing(wanted)

    def contains(self, key: bytes, layer_group_id: int) -> bool:
        return (key, layer_group_id) in self._present

    def lookup(self, key: bytes, layer_group_id: int) -> Entry | None:
        entry = (key, layer_group_id)
        return entry if entry in self._present else None

    def secure(self, plan: dict[tuple[int, int], Any]) -> dict[tuple[int, int], Any] | None:
        fetched = self.store.fetch(list(plan.values()))
        vanished = {entry for entry, staged in fetched.items() if staged is None}
        if vanished:
            self._present -= vanished
            return None
        self.store.touch(list(plan.values()))
        return {where: fetched[entry] for where, entry in plan.items()}

    def end_ask(self) -> None:
        self._present = set()

    def reserve(self, key: bytes, layer_group_id: int) -> Entry:
        return key, layer_group_id

    def pin(self, location: StagedEntry) -> None:
        self.num_staged_bytes += location.nbytes

    def unpin(self, location: StagedEntry) -> None:
        self.num_staged_bytes -= location.nbytes

    def kvtool_introspection(self) -> Introspection:
        return replace(super().kvtool_introspection(), staged_bytes=self.num_staged_bytes,
                       ask_errors=self.store.num_errors, corrupt_entries=self.store.num_corrupt,
                       evicted_entries=self.store.evicted_total())


class RemoteStoreWorker(BlockStoreWorker):
    store_class: type[RemoteBlockStore]

    def open_store(self, layout: KvCacheLayout) -> None:
        self.store = self.store_class(self._llm_args)
        self._last_layer = max(layer for g in layout.layer_groups for layer in g.layer_ids)

    def load(self, transfers: Sequence[PageTransfer], layer_id: int | None = None) -> None:
        rank = self._llm_args.rank
        self.load_payloads(transfers, layer_id, lambda batch: [t.location.payloads[rank] for t in batch])

    def save(self, transfers: Sequence[PageTransfer], layer_id: int | None = None) -> None:
        if layer_id is not None and layer_id != self._last_layer:
            return   # a value holds every layer of its page: write it once the last layer is done
        if transfers:
            self.store.put(((t.key, t.layer_group_id), payload)
                           for t, payload in zip(transfers, self.saved_payloads(transfers), strict=True))


class RemoteIndexScheduler(RemoteStoreScheduler):
    kvtool_moves_bytes = False
    """Read by the engine: this connector stands in for byte movement (block fidelity only)."""

    def staging_room(self) -> None:
        return None                # nothing is staged

    def secure(self, plan: dict[tuple[int, int], Any]) -> dict[tuple[int, int], Any]:
        self.store.touch(list(plan.values()))    # a bounded store counts the use
        return plan                # nothing will be read: there is no window to close

    def pin(self, location: Entry | StagedEntry) -> None:   # an Entry here: secure() stages nothing
        pass

    def unpin(self, location: Entry | StagedEntry) -> None:
        pass


class RemoteIndexWorker(BlockStoreWorker):
    kvtool_moves_bytes = False
    store_class: type[RemoteBlockStore]

    def open_store(self, layout: KvCacheLayout) -> None:
        self.store = self.store_class(self._llm_args, payloads=False)
        self._last_layer = max(layer for g in layout.layer_groups for layer in g.layer_ids)

    def load(self, transfers: Sequence[PageTransfer], layer_id: int | None = None) -> None:
        """Nothing moves in block fidelity."""

    def save(self, transfers: Sequence[PageTransfer], layer_id: int | None = None) -> None:
        if transfers and layer_id in (None, self._last_layer):
            self.store.put(((t.key, t.layer_group_id), b"") for t in transfers)
