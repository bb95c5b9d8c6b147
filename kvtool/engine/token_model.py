"""The `tokens` fidelity: what a `bytes` run generates, without its bytes.

A run with no connector moves no page but its own writes, so every read of a correct run finds
exactly the fingerprints written there. This model computes a sampling pass's digest from those
expected fingerprints and writes, reads and checks nothing; its tokens are the fake engine's,
digest for digest. It is for reference runs, whose only product is their tokens
(validate's `reference_tokens`); the fake engine's own tests prove the premise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np
import torch

from kvtool.engine.expected_cache import ExpectedBytesCache
from kvtool.engine.fake_engine import FakeEngine
from kvtool.engine.fingerprint import PrefixHashes
from kvtool.engine.integrity import CHECKSUM_MASK, digest
from kvtool.engine.pass_types import PagesByGroup, PassItem
from kvtool.manager.layer_groups import LayerGroupSpec


class ReferenceTokens(FakeEngine):
    """A `FakeEngine` that writes nothing and reads what it would have written."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._row_sums = ExpectedBytesCache()
        """Per (request, layer): each position's byte sum over the layer's buffers, what a digest weighs."""

    def forward_layer(self, layer_id: int, items: list[PassItem]) -> None:
        """Only the passes that sample read, and only for their digest: `FakeEngine.forward_layer`'s,
        from each position's expected byte sum instead of the bytes found."""
        group = self._group_of[layer_id]
        for item in items:
            if not item.samples:
                continue
            hashes = self._prefix_hashes(item)
            pages = item.pages[group.layer_group_id]
            readable = self._positions_in_live_blocks(group, pages, item.end, item.start)
            if not len(readable) or self._page_ids(group, item.request_id, pages, readable, layer_id, "read") is None:
                continue
            rows = self._row_sums.at(item.request_id, layer_id, hashes.array(), readable,
                                     lambda some: [self._byte_sums(layer_id, some)])[0]
            last = item.sampled_after
            attended = self._positions_in_live_blocks(group, pages, last, last)
            item.checksum = (item.checksum + digest(rows, readable, attended, layer_id)) & CHECKSUM_MASK

    def forget(self, request_id: int) -> None:
        super().forget(request_id)
        self._row_sums.forget(request_id)

    def _byte_sums(self, layer_id: int, prefix_hashes: np.ndarray) -> torch.Tensor:
        """int64 [positions]: each position's fingerprint bytes summed over the layer's buffers."""
        parts = self._expected(self._buffers[layer_id], layer_id, prefix_hashes)
        # a tensor: a layer has at least one buffer
        return cast(torch.Tensor, sum(part.reshape(len(prefix_hashes), -1).to(torch.int64).sum(dim=1)
                                      for part in parts))

    def _write(self, layer_id: int, group: LayerGroupSpec, item: PassItem, hashes: PrefixHashes,
               positions: np.ndarray) -> None:
        """Nothing written (`write_context`): nothing reads the pages."""

    def verify_cache(self, request_id: int, tokens: Sequence[int], pages: PagesByGroup,
                     history: int) -> None:
        """Nothing to check: nothing but this run touched the pages."""
