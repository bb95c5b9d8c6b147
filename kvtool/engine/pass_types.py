"""The types of a forward pass as the engine and its bytes models share them: what one request
computes in a pass (`PassItem`), a wrong byte found (`IntegrityIssue`), and the face every
fidelity's bytes model shows the engine (`KvBytesModel`: the fingerprinting `FakeEngine`, block
fidelity's `NoBytesModel`, the reference runs' `ReferenceTokens`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

PagesByGroup = Mapping[int, Sequence[int]] | Sequence[Sequence[int]]
"""A request's page index per block ordinal, indexed by layer group id (the manager's `GroupPages`)."""


@dataclass(frozen=True)
class IntegrityIssue:
    request_id: int
    layer_group_id: int
    block_ordinal: int
    layer_id: int
    role: str
    position: int
    head: int
    expected: str
    found: str
    what: str = "mismatch"
    rank: int = 0

    def describe(self) -> str:
        where = f"rank {self.rank}, " if self.rank else ""
        return (f"{where}request {self.request_id}, layer group {self.layer_group_id}, block {self.block_ordinal}, "
                f"layer {self.layer_id}, {self.role}, position {self.position}, head {self.head}: "
                f"{self.what} (expected {self.expected}, found {self.found})")


@dataclass
class PassItem:
    """One request's share of a forward pass: compute positions [start, end) of `tokens`."""

    request_id: int
    tokens: Sequence[int]
    pages: PagesByGroup
    """Page indices per layer group (a `GroupPages` from the manager)."""
    start: int
    end: int
    samples: bool
    checksum: int = 0
    sample_end: int | None = None
    """The token sampled is the one after position `sample_end - 1` (default `end - 1`): a verify
    pass of drafts samples after the last accepted one, attending to the positions before it."""

    @property
    def sampled_after(self) -> int:
        return self.end if self.sample_end is None else self.sample_end


@runtime_checkable
class KvBytesModel(Protocol):
    """What writes a pass's KV into the pages and checks what it reads back. Its contract: after
    `forward_layer` of every layer of a pass, each item's attended positions were read and
    compared (a mismatch counted in `num_integrity_errors`, `errors_by_request`, the first ones
    kept in `issues`) and its computed positions written; `sample` is a function of what was read."""

    @property
    def layer_ids(self) -> Sequence[int]:
        """The layers it writes and reads, in forward order."""

    @property
    def issues(self) -> list[IntegrityIssue]:
        """The first wrong bytes found, with their coordinates."""

    @property
    def errors_by_request(self) -> Counter:
        """Every wrong byte counted, by request id."""

    @property
    def num_integrity_errors(self) -> int:
        """Every wrong byte counted."""

    def forget(self, request_id: int) -> None:
        """Drop what is kept for a request that ended."""

    def rewind(self, request_id: int, length: int) -> None:
        """The request's tokens from `length` on are void (drafts rejected, a replay)."""

    def forward_layer(self, layer_id: int, items: list[PassItem]) -> None:
        """One layer of the pass: read and check each item's context, write its new positions."""

    def write_context(self, item: PassItem) -> None:
        """Write a context received from elsewhere (a generation-only request) on every layer."""

    def verify_cache(self, request_id: int, tokens: Sequence[int], pages: PagesByGroup,
                     history: int) -> None:
        """Check the first `history` positions of `tokens` in `pages` (counted as any read is)."""

    def merge(self, issues: list[IntegrityIssue], errors_by_request: Counter, rank: int) -> None:
        """Fold another rank's findings into these."""

    def sample(self, item: PassItem) -> int:
        """The token sampled after `item`'s pass."""
