"""`stacked-index`: tiers as a deployment stacks them, GPU -> host -> shared remote, for block
fidelity (nothing moves; the decisions and counts are a real stack's).

- host: this engine's own tier, an in-process index per layer group (`capacity`, `eviction`: the
  `index` connector's);
- remote: a Redis server every engine of a fleet shares (`url`, ..., bounded by `remote_capacity`
  and `remote_eviction`: the `redis-index` tier's).

An ask serves the longest run of blocks the two hold together, each block from the host when it is
there, else from the remote (one batched existence check for the blocks the host lacks); a block
loaded from the remote is written into the host tier (promoted). A save writes a computed block to
both (write-through; the remote in one batch a pass). Each delivery is split by tier
(`kvtool_tier_tokens`: the cost model loads each part at its tier's rate, `--load-gbps` and
`--remote-gbps`), and the tokens served by each tier are counted (`tier_hit_tokens`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from kvtool.connector.api import SchedulerOutput
from kvtool.connector.introspection import Introspection
from kvtool.connector.llm_args import LlmArgs
from kvtool.connector.options import ConnectorOption
from kvtool.connectors.host import DEFAULT_EVICTION, EVICTION_OPTION
from kvtool.connectors.index import DEFAULT_CAPACITY_TOKENS, IndexConnectorWorker
from kvtool.connectors.metadata import PageTransfer, StoreMetadata
from kvtool.connectors.redis_store import REDIS_OPTIONS, RedisBlockStore
from kvtool.connectors.remote_store import Entry
from kvtool.connectors.slot_index import EVICTION_POLICIES, slot_index
from kvtool.connectors.store_scheduler import STORE_OPTIONS, BlockStoreScheduler
from kvtool.units import parse_capacity

HOST, REMOTE = "host", "remote"
_REMOTE_ONLY = ("capacity", "eviction", "staging")
"""Options of the redis connectors the stack's remote level does not take (it has its own)."""

STACKED_OPTIONS = STORE_OPTIONS + (
    ConnectorOption("capacity", "the host tier: tokens (1e6) or a size (64GiB) of whole blocks a layer group",
                    DEFAULT_CAPACITY_TOKENS, check=parse_capacity),
    EVICTION_OPTION,
    ConnectorOption("remote_capacity", "bound the shared remote tier: tokens or a size (1TiB), every engine's "
                    "blocks together [default: no bound]", None, check=parse_capacity),
    ConnectorOption("remote_eviction", "which block the bounded remote tier drops: lru or lfu", DEFAULT_EVICTION,
                    tuple(EVICTION_POLICIES)),
) + tuple(o for o in REDIS_OPTIONS if o.name not in _REMOTE_ONLY)

Location = tuple[str, int, Any]
"""(tier, layer group, host slot or remote key)."""


class StackedIndexScheduler(BlockStoreScheduler):
    kvtool_options = STACKED_OPTIONS
    kvtool_moves_bytes = False
    """Read by the engine: this connector stands in for byte movement (block fidelity only)."""

    def __init__(self, llm_args: LlmArgs) -> None:
        super().__init__(llm_args)
        options = llm_args.connector_options
        capacity = parse_capacity(options.get("capacity", DEFAULT_CAPACITY_TOKENS))
        blocks = capacity.blocks(sum(g.bytes_per_page for g in self.groups), self.tokens_per_block)
        policy = options.get("eviction", DEFAULT_EVICTION)
        self.host = {g.layer_group_id: slot_index(policy, blocks) for g in self.groups}
        self.remote = RedisBlockStore(llm_args, payloads=False, bound_keys=("remote_capacity", "remote_eviction"))
        self.hit_tokens = {HOST: 0, REMOTE: 0}
        self._present: set[Entry] = set()
        self._writes: list[Entry] = []
        self._splits: dict[int, dict[str, int]] = {}
        """Splits of this iteration's deliveries (read by the cost model once the pass is over)."""
        self._delivered_since_meta: set[int] = set()

    # ---- the store -------------------------------------------------------------------------------
    def begin_ask(self, keys: list[bytes], first: int) -> None:
        missing = [(key, g) for key in keys[first:] for g in self.host if key not in self.host[g]]
        self._present = self.remote.existing(missing)

    def end_ask(self) -> None:
        self._present = set()

    def contains(self, key: bytes, layer_group_id: int) -> bool:
        return key in self.host[layer_group_id] or (key, layer_group_id) in self._present

    def lookup(self, key: bytes, layer_group_id: int) -> Location | None:
        slot = self.host[layer_group_id].lookup(key)
        if slot is not None:
            return HOST, layer_group_id, slot
        return (REMOTE, layer_group_id, key) if (key, layer_group_id) in self._present else None

    def secure(self, plan: dict[tuple[int, int], Any]) -> dict[tuple[int, int], Any]:
        self.remote.touch([(loc[2], loc[1]) for loc in plan.values() if loc[0] == REMOTE])
        return plan

    def reserve(self, key: bytes, layer_group_id: int) -> Location | None:
        """Write-through: the host tier takes the block (if it has not got it) and so does the remote."""
        self._writes.append((key, layer_group_id))
        slot = self.host[layer_group_id].reserve(key)
        return (HOST, layer_group_id, slot) if slot is not None else (REMOTE, layer_group_id, key)

    def discard(self, key: bytes, layer_group_id: int, location: Location) -> None:
        self.host[layer_group_id].discard(key)
        self._writes = [w for w in self._writes if w != (key, layer_group_id)]

    def pin(self, location: Location) -> None:
        if location[0] == HOST:
            self.host[location[1]].pin(location[2])

    def unpin(self, location: Location) -> None:
        if location[0] == HOST:
            self.host[location[1]].unpin(location[2])

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StoreMetadata:
        meta = super().build_connector_meta(scheduler_output)
        self._splits = {r: split for r, split in self._splits.items() if r in self._delivered_since_meta}
        self._delivered_since_meta = set()
        if self._writes:
            self.remote.put((entry, b"") for entry in self._writes)
            self._writes = []
        return meta

    # ---- where a delivery comes from ---------------------------------------------------------------
    def delivered(self, request_id: int, span: tuple[int, int], loads: list[PageTransfer]) -> None:
        """Split the delivery by tier (a block from the remote if any of its pages is), count it,
        and promote the remote's blocks into the host tier."""
        start, end = span
        tpb = self.tokens_per_block
        tier_of: dict[int, str] = {}
        for load in loads:
            if load.location[0] == REMOTE:
                tier_of[load.block_ordinal] = REMOTE
                self.host[load.layer_group_id].reserve(load.key)
            else:
                tier_of.setdefault(load.block_ordinal, HOST)
        split = {HOST: 0, REMOTE: 0}
        for j, tier in tier_of.items():
            split[tier] += max(0, min(end, (j + 1) * tpb) - max(start, j * tpb))
        for tier, tokens in split.items():
            self.hit_tokens[tier] += tokens
        self._splits[request_id] = split
        self._delivered_since_meta.add(request_id)

    def kvtool_tier_tokens(self, request_id: int) -> Mapping[str, int]:
        """Tokens of the request's latest delivery per tier (the cost model's `TierSplit`)."""
        return self._splits.get(request_id, {})

    def kvtool_introspection(self) -> Introspection:
        return replace(super().kvtool_introspection(),
                       stored_entries=sum(len(i) for i in self.host.values()),
                       evicted_entries=sum(i.num_evictions for i in self.host.values()),
                       tier_hit_tokens=tuple(self.hit_tokens.items()))


class StackedIndexWorker(IndexConnectorWorker):
    """Nothing moves in block fidelity; the scheduler keeps both tiers' indexes."""
