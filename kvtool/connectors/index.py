"""`index`: a connector tier that keeps only the index of what it stores, for block fidelity.

The scheduler half is the host connector's (the same keys, plans, cancels, saves and LRU
`SlotIndex` per layer group), so a block-fidelity replay makes the same decisions a host tier of
the same capacity makes with bytes; the worker half moves nothing. Its capacity is counted in
tokens (`capacity`, e.g. `1e6`; blocks = capacity // tokens_per_block, per layer group), which is
how tiers are sized in a sweep. It serves no bytes, so it only runs where none are read
(`kvtool trace run --fidelity blocks`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from kvtool.connector.introspection import Introspection
from kvtool.connector.llm_args import LlmArgs
from kvtool.connector.options import ConnectorOption
from kvtool.connectors.host import HostConnectorScheduler, SlotIndex
from kvtool.connectors.metadata import PageTransfer
from kvtool.connectors.store_scheduler import STORE_OPTIONS
from kvtool.connectors.store_worker import BlockStoreWorker
from kvtool.manager.layout import KvCacheLayout

DEFAULT_CAPACITY_TOKENS = "1e6"


def parse_token_count(text: str) -> int:
    """A positive number of tokens, written `1000000`, `1e6` or `1_000_000`; ValueError otherwise."""
    try:
        value = float(str(text).replace("_", ""))
    except ValueError:
        raise ValueError(f"not a number of tokens: {text!r}") from None
    if not value >= 1 or value != value or value == float("inf") or value != int(value):
        raise ValueError(f"a capacity in tokens must be a whole number >= 1, got {text!r}")
    return int(value)


class IndexConnectorScheduler(HostConnectorScheduler):
    kvtool_options = STORE_OPTIONS + (
        ConnectorOption("capacity", "tokens the tier holds, e.g. 1e6 (whole blocks per layer group)",
                        DEFAULT_CAPACITY_TOKENS, check=parse_token_count),
    )
    kvtool_moves_bytes = False
    """Read by the engine: this connector stands in for byte movement (block fidelity only)."""

    def __init__(self, llm_args: LlmArgs) -> None:
        super(HostConnectorScheduler, self).__init__(llm_args)
        tokens = parse_token_count(llm_args.connector_options.get("capacity", DEFAULT_CAPACITY_TOKENS))
        self.capacity_blocks = max(tokens // self.tokens_per_block, 1)
        self.indexes = {g.layer_group_id: SlotIndex(self.capacity_blocks) for g in self.groups}

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
