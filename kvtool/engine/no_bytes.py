"""The model of block fidelity: the fake engine's interface, with no KV bytes behind it.

Pools are virtual, so nothing is written or verified: a replay keeps the manager's, scheduler's
and connector's every decision (pages, hits, cancels, saves, loads, evictions) and drops the cost
of moving bytes. Sampled tokens are a function of the request and position only (a bytes replay
samples from the KV it read, so the two fidelities generate different tokens; prompts, hence
prefix reuse, are the same).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from kvtool.engine.fake_engine import VOCAB_SIZE
from kvtool.engine.pass_types import IntegrityIssue, PagesByGroup, PassItem
from kvtool.manager.layer_groups import LayerGroupSpec


class NoBytesModel:
    num_integrity_errors = 0

    def __init__(self, layer_groups: tuple[LayerGroupSpec, ...]) -> None:
        self.layer_ids = sorted(layer for group in layer_groups for layer in group.layer_ids)
        self.issues: list[IntegrityIssue] = []
        self.errors_by_request: Counter = Counter()

    def rewind(self, request_id: int, length: int) -> None:
        pass

    def forget(self, request_id: int) -> None:
        """Nothing is kept per request."""

    def forward_layer(self, layer_id: int, items: list[PassItem]) -> None:
        """Nothing is written or read."""

    def write_context(self, item: PassItem) -> None:
        """Nothing is written."""

    def verify_cache(self, request_id: int, tokens: Sequence[int], pages: PagesByGroup,
                     history: int) -> None:
        """Nothing can be checked."""

    def merge(self, issues: list[IntegrityIssue], errors_by_request: Counter, rank: int) -> None:
        """Block fidelity runs one rank."""

    def sample(self, item: PassItem) -> int:
        return (item.request_id * 1_000_003 + item.end * 7919) % VOCAB_SIZE
