"""`index`: a connector tier that keeps only the index of what it stores, for block fidelity.

The scheduler half is the host connector's (the same keys, plans, cancels, saves and `SlotIndex`
per layer group, LRU or LFU: `eviction`), so a block-fidelity replay makes the same decisions a
host tier of the same capacity makes with bytes; the worker half moves nothing. Its `capacity` is
tokens (`1e6`: capacity // tokens_per_block blocks per layer group) or a size (`64GiB`: the bytes
of that many blocks of this rank's shard, every layer group, as a host tier of that size holds),
which is how tiers are sized in a sweep. It serves no bytes, so it only runs where none are read
(`kvtool trace run --fidelity blocks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from kvtool.connector.introspection import Introspection
from kvtool.connector.llm_args import LlmArgs
from kvtool.connector.options import ConnectorOption
from kvtool.connectors.host import DEFAULT_EVICTION, EVICTION_OPTION, HostConnectorScheduler
from kvtool.connectors.metadata import PageTransfer
from kvtool.connectors.slot_index import slot_index
from kvtool.connectors.store_scheduler import STORE_OPTIONS
from kvtool.connectors.store_worker import BlockStoreWorker
from kvtool.manager.layout import KvCacheLayout
from kvtool.units import parse_capacity, parse_token_count

__all__ = ["IndexConnectorScheduler", "IndexConnectorWorker", "parse_token_count"]

DEFAULT_CAPACITY_TOKENS = "1e6"


class IndexConnectorScheduler(HostConnectorScheduler):
    kvtool_options = STORE_OPTIONS + (
        ConnectorOption("capacity", "what the tier holds: tokens (1e6) or a size (64GiB; SI units such as 10GB "
                        "too), in whole blocks per layer group", DEFAULT_CAPACITY_TOKENS, check=parse_capacity),
        EVICTION_OPTION,
    )
    kvtool_moves_bytes = False
    """Read by the engine: this connector stands in for byte movement (block fidelity only)."""

    def __init__(self, llm_args: LlmArgs) -> None:
        super(HostConnectorScheduler, self).__init__(llm_args)
        options = llm_args.connector_options
        capacity = parse_capacity(options.get("capacity", DEFAULT_CAPACITY_TOKENS))
        self.capacity_blocks = capacity.blocks(sum(g.bytes_per_page for g in self.groups), self.tokens_per_block)
        policy = options.get("eviction", DEFAULT_EVICTION)
        self.indexes = {g.layer_group_id: slot_index(policy, self.capacity_blocks) for g in self.groups}

    def kvtool_introspection(self) -> Introspection:
        return replace(super().kvtool_introspection(), stored_entries=sum(len(i) for i in self.indexes.values()))


class IndexConnectorWorker(BlockStoreWorker):
    kvtool_moves_bytes = False

    def open_store(self, layout: KvCacheLayout) -> None:
        """Nothing to open: the index lives in the scheduler."""

    def load(self, transfers: Sequence[PageTransfer], layer_id: int | None = None) -> None:
        """Nothing moves in block fidelity."""

    def save(self, transfers: Sequence[PageTransfer], layer_id: int | None = None) -> None:
        """Nothing moves in block fidelity."""
