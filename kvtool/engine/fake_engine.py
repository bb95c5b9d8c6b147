"""The fake engine: writes fingerprints into the real page bytes and verifies every read.

A forward pass over one layer, for each request, writes the fingerprints of the positions it
computes, then reads every earlier position the layer attends to (all blocks of full attention,
sink blocks and the live window of sliding groups) and compares with what a full recompute would
have written. Mismatches are counted and the first ones recorded with their coordinates.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from kvtool.engine.byte_origin import Coordinate, Origins, found_bytes
from kvtool.engine.expected_cache import ExpectedBytesCache
from kvtool.engine.fingerprint import PrefixHashes, expected_bytes, sample_token
from kvtool.engine.integrity import CHECKSUM_MASK, digest, moved
from kvtool.engine.pass_types import IntegrityIssue, PagesByGroup, PassItem
from kvtool.manager.layer_groups import BufferId, LayerGroupSpec
from kvtool.manager.layout import KvCacheLayout, KvCacheRegion
from kvtool.types import BAD_PAGE_INDEX

VOCAB_SIZE = 32000
MAX_RECORDED_ISSUES = 50
HOST_COMPARE_BYTES = 1 << 20
"""A layer's read of at most this many bytes from GPU pages is compared on the host: one copy
costs less than the compare's kernels and a synchronisation per buffer, and under validate's
dozen processes sharing one GPU every synchronisation waits its turn. Larger reads (a real model
in `bench`) are compared where they are."""


@dataclass
class _LayerBuffer:
    region: KvCacheRegion
    index: int
    buffer: BufferId
    num_heads: int
    head_bytes: int
    first_head: int


@dataclass
class FakeEngine:
    layout: KvCacheLayout
    layer_groups: tuple[LayerGroupSpec, ...]
    seed: int = 0
    num_integrity_errors: int = 0
    issues: list[IntegrityIssue] = field(default_factory=list)
    """The first MAX_RECORDED_ISSUES, with coordinates."""
    errors_by_request: Counter = field(default_factory=Counter)
    """Every error counted, by request id."""
    model_heads: int = 0
    """Heads per buffer of the whole model, every tensor-parallel rank's (`models.heads_across_ranks`),
    traced in wrong bytes (`byte_origin`); 0: this shard's last head."""
    delay_writes: Callable[[], None] | None = None
    """Device pages under validate (`stream_races`): called before a layer's writes are enqueued,
    after its reads of earlier positions (so loaded pages are read as early as stream order allows,
    and the writes land as late as it allows; the positions a pass writes are read back by the
    next pass and the end-of-iteration check, not by the pass itself)."""

    def __post_init__(self) -> None:
        self._hashes: dict[int, PrefixHashes] = {}
        self._expected_cache = ExpectedBytesCache()
        self._views: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        self._buffers: dict[int, list[_LayerBuffer]] = {}
        self._group_of: dict[int, LayerGroupSpec] = {}
        for group in self.layer_groups:
            group_layout = self.layout.group(group.layer_group_id)
            for layer_id in group.layer_ids:
                self._group_of[layer_id] = group
            for region in group_layout.regions:
                for index, (buffer, spec) in enumerate(zip(region.buffers, region.buffer_specs, strict=True)):
                    head_bytes = region.buffer_bytes // (self.layout.tokens_per_block * spec.num_heads)
                    self._buffers.setdefault(buffer.layer_id, []).append(
                        _LayerBuffer(region, index, buffer, spec.num_heads, head_bytes, spec.first_head))
        self.layer_ids = sorted(self._buffers)
        last_head = max(lb.first_head + lb.num_heads for buffers in self._buffers.values() for lb in buffers)
        self._origins = Origins(self._hashes, self.layer_ids, max(self.model_heads, last_head))

    # ---- public ------------------------------------------------------------------------------
    def forget(self, request_id: int) -> None:
        self._origins.forget(request_id)
        self._expected_cache.forget(request_id)
        self._hashes.pop(request_id, None)

    def rewind(self, request_id: int, length: int) -> None:
        """The request's tokens from `length` on were drafts it rejected: forget their hashes."""
        hashes = self._hashes.get(request_id)
        if hashes is not None:
            hashes.truncate(length)

    def forward_layer(self, layer_id: int, items: list[PassItem]) -> None:
        """Write positions [start, end) of `layer_id` for each item, then verify what it attends to
        (with `delay_writes`: read first, then the delay, then every item's writes)."""
        if self.delay_writes is not None:
            self._read_then_write(layer_id, items, self.delay_writes)
            return
        group = self._group_of[layer_id]
        for item in items:
            hashes = self._prefix_hashes(item)
            pages = item.pages[group.layer_group_id]
            self._write(layer_id, group, item, hashes, np.arange(item.start, item.end, dtype=np.int64))
            readable = self._positions_in_live_blocks(group, pages, item.end, item.start)
            found = self._verify(layer_id, group, item.request_id, pages, hashes, readable)
            if item.samples and found is not None:
                last = item.sampled_after
                item.checksum = (item.checksum + self._checksum(found, readable, self._positions_in_live_blocks(
                    group, pages, last, last), layer_id)) & CHECKSUM_MASK

    def _read_then_write(self, layer_id: int, items: list[PassItem], delay: Callable[[], None]) -> None:
        """`forward_layer` on device pages under validate: each item's earlier positions read and
        verified, then `delay()`, then every item's writes enqueued with no synchronisation after
        them; a sampling item's checksum takes the bytes it writes as written."""
        group = self._group_of[layer_id]
        writes = []
        for item in items:
            hashes = self._prefix_hashes(item)
            pages = item.pages[group.layer_group_id]
            readable = self._positions_in_live_blocks(group, pages, item.end, item.start)
            earlier = readable[readable < item.start]
            found = self._verify(layer_id, group, item.request_id, pages, hashes, earlier)
            writes.append(self._prepared_write(layer_id, group, item, hashes, np.arange(item.start, item.end,
                                                                                         dtype=np.int64)))
            if item.samples and (found is not None or not len(earlier)):
                rows = self._with_written(layer_id, item, hashes, found, readable[readable >= item.start])
                last = item.sampled_after
                item.checksum = (item.checksum + self._checksum(rows, readable, self._positions_in_live_blocks(
                    group, pages, last, last), layer_id)) & CHECKSUM_MASK
        delay()
        for write in writes:
            for view, index, where, part in write:
                view[where[0], index, where[1]] = part

    def _with_written(self, layer_id: int, item: PassItem, hashes: PrefixHashes, found: torch.Tensor | None,
                      fresh: np.ndarray) -> torch.Tensor:
        """`found` (rows of the earlier positions) followed by the rows `fresh` positions are written with."""
        buffers = self._buffers[layer_id]
        written = self._expected_at(item.request_id, buffers, layer_id, hashes, fresh)
        rows = torch.cat([part.reshape(len(fresh), -1) for part in written], dim=1)
        return rows if found is None else torch.cat([found, rows.to(found.device)], dim=0)

    @staticmethod
    def _checksum(found: torch.Tensor, positions: np.ndarray, attended: np.ndarray, layer_id: int) -> int:
        """`digest` of the bytes `found` at `positions` (a row each)."""
        return digest(found.to(torch.int64).sum(dim=1), positions, attended, layer_id)

    def merge(self, issues: list[IntegrityIssue], errors_by_request: Counter, rank: int) -> None:
        """Count another rank's integrity errors here (its issues marked with the rank)."""
        self.num_integrity_errors += sum(errors_by_request.values())
        self.errors_by_request.update(errors_by_request)
        room = MAX_RECORDED_ISSUES - len(self.issues)
        self.issues.extend(replace(issue, rank=rank) for issue in issues[:max(room, 0)])

    def sample(self, item: PassItem) -> int:
        return sample_token(int(self._prefix_hashes(item).array()[item.sampled_after - 1]), item.checksum, VOCAB_SIZE)

    def verify_cache(self, request_id: int, tokens: Sequence[int], pages: PagesByGroup,
                     history: int) -> None:
        """Check every position below `history` still backed by a page, in every layer."""
        item = PassItem(request_id, tokens, pages, history, history, samples=False)
        hashes = self._prefix_hashes(item)
        for layer_id in self.layer_ids:
            group = self._group_of[layer_id]
            group_pages = pages[group.layer_group_id]
            self._verify(layer_id, group, request_id, group_pages, hashes,
                         self._positions_in_live_blocks(group, group_pages, history, history))

    def write_context(self, item: PassItem) -> None:
        """Write every layer for [start, end) without a pass: KV that arrived from elsewhere (a
        context server, or a test's oracle connector). Blocks with no page are skipped."""
        hashes = self._prefix_hashes(item)
        for layer_id in self.layer_ids:
            group = self._group_of[layer_id]
            positions = self._positions_with_pages(item.pages[group.layer_group_id], item.start, item.end)
            self._write(layer_id, group, item, hashes, positions)   # one write a layer: on a GPU, each costs syncs

    # ---- internals ---------------------------------------------------------------------------
    def _prefix_hashes(self, item: PassItem) -> PrefixHashes:
        hashes = self._hashes.setdefault(item.request_id, PrefixHashes(self.seed))
        hashes.extend_to(item.tokens[:max(item.end, len(hashes))])
        return hashes

    def _positions_in_live_blocks(self, group: LayerGroupSpec, pages: Sequence[int], end: int,
                                  history: int) -> np.ndarray:
        """Positions below `end` in blocks that are not stale at `history`."""
        tpb = self.layout.tokens_per_block
        stale = group.stale_range(history, tpb)
        positions = np.arange(max(end, 0), dtype=np.int64)
        if not len(stale):
            return positions
        # stale blocks are one run (`stale_block_range`): the positions between its ends go
        return positions[(positions < stale.start * tpb) | (positions >= stale.stop * tpb)]

    def _positions_with_pages(self, pages: Sequence[int], start: int, end: int) -> np.ndarray:
        """Positions in [start, end) whose block has a page (not past `pages`, not BAD_PAGE_INDEX)."""
        positions = np.arange(start, end, dtype=np.int64)
        ordinals = positions // self.layout.tokens_per_block
        has_page = ordinals < len(pages)
        has_page[has_page] = np.asarray(pages, dtype=np.int64)[ordinals[has_page]] != BAD_PAGE_INDEX
        return positions[has_page]

    def _write(self, layer_id: int, group: LayerGroupSpec, item: PassItem, hashes: PrefixHashes,
               positions: np.ndarray) -> None:
        for view, index, where, part in self._prepared_write(layer_id, group, item, hashes, positions):
            view[where[0], index, where[1]] = part

    def _prepared_write(self, layer_id: int, group: LayerGroupSpec, item: PassItem, hashes: PrefixHashes,
                        positions: np.ndarray) -> list[tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]]:
        """The writes of `positions` as (view, buffer index, where, bytes), every operand already on
        the pages' device (what remains is one indexed store each)."""
        if not len(positions):
            return []
        pages = item.pages[group.layer_group_id]
        page_ids = self._page_ids(group, item.request_id, pages, positions, layer_id, "write")
        if page_ids is None:
            return []
        buffers = self._buffers[layer_id]
        views = [self._view(lb) for lb in buffers]
        where = self._slots_and_offsets(page_ids, positions, views[0].device)
        expected = moved(self._expected_at(item.request_id, buffers, layer_id, hashes, positions), views[0].device)
        return [(view, lb.index, where, part) for view, lb, part in zip(views, buffers, expected, strict=True)]

    def _slots_and_offsets(self, page_ids: np.ndarray, positions: np.ndarray, device: torch.device) -> torch.Tensor:
        """[2, n] on `device`: each position's page and its offset in the block, moved in one copy
        (shared by a layer's buffers, which live on one device)."""
        pairs = np.stack([page_ids, positions % self.layout.tokens_per_block])
        return torch.from_numpy(pairs).to(device)

    def _verify(self, layer_id: int, group: LayerGroupSpec, request_id: int, pages: Sequence[int],
                hashes: PrefixHashes, positions: np.ndarray) -> torch.Tensor | None:
        """Compare the bytes at `positions`; return them (all buffers of the layer) for checksums."""
        if not len(positions):
            return None
        page_ids = self._page_ids(group, request_id, pages, positions, layer_id, "read")
        if page_ids is None:
            return None
        buffers = self._buffers[layer_id]
        views = [self._view(lb) for lb in buffers]
        where = self._slots_and_offsets(page_ids, positions, views[0].device)
        found = [view[where[0], lb.index, where[1]] for view, lb in zip(views, buffers, strict=True)]
        if found[0].device.type != "cpu" and sum(part.numel() for part in found) <= HOST_COMPARE_BYTES:
            found = moved(found, torch.device("cpu"))
        expected = moved(self._expected_at(request_id, buffers, layer_id, hashes, positions), found[0].device)
        for lb, found_part, expected_part in zip(buffers, found, expected, strict=True):
            if torch.equal(found_part, expected_part):
                continue
            bad = (found_part != expected_part).any(dim=-1)
            self._record(request_id, group, layer_id, lb, positions, bad, expected_part, found_part)
        return torch.cat([part.reshape(len(positions), -1) for part in found], dim=1)

    def _expected_at(self, request_id: int, buffers: list[_LayerBuffer], layer_id: int, hashes: PrefixHashes,
                     positions: np.ndarray) -> list[torch.Tensor]:
        """`_expected` of the request's `positions`, each computed once (`ExpectedBytesCache`)."""
        return self._expected_cache.at(request_id, layer_id, hashes.array(), positions,
                                       lambda some: self._expected(buffers, layer_id, some))

    @staticmethod
    def _expected(buffers: list[_LayerBuffer], layer_id: int, prefix_hashes: np.ndarray) -> list[torch.Tensor]:
        """Each buffer's expected bytes, uint8 [positions, heads, head bytes], on the host."""
        return [torch.from_numpy(np.ascontiguousarray(expected_bytes(
            prefix_hashes, layer_id, lb.buffer.role, lb.num_heads, lb.head_bytes, lb.first_head))) for lb in buffers]

    def _page_ids(self, group: LayerGroupSpec, request_id: int, pages: Sequence[int], positions: np.ndarray,
                  layer_id: int, what: str) -> np.ndarray | None:
        tpb = self.layout.tokens_per_block
        ordinals = positions // tpb
        if len(ordinals) and ordinals.max() >= len(pages):
            self._issue(request_id, group, int(ordinals.max()), layer_id, "-", int(positions.max()), -1,
                        f"{what} past the request's pages ({len(pages)} blocks)")
            return None
        page_ids = np.asarray(pages, dtype=np.int64)[ordinals]
        missing = np.nonzero(page_ids == BAD_PAGE_INDEX)[0]
        if len(missing):
            p = int(positions[missing[0]])
            self._issue(request_id, group, p // tpb, layer_id, "-", p, -1, f"{what} of a block with no page")
            return None
        return page_ids

    def _view(self, lb: _LayerBuffer) -> torch.Tensor:
        """`lb`'s region as [slots, buffers, tokens, heads, head bytes], made once per storage tensor."""
        region = lb.region
        cached = self._views.get(id(lb))
        if cached is not None and cached[0] is region.storage:
            return cached[1]
        view = region.as_tensor().view(region.num_slots, len(region.buffers), self.layout.tokens_per_block,
                                       lb.num_heads, lb.head_bytes)
        self._views[id(lb)] = (region.storage, view)
        return view

    def _record(self, request_id: int, group: LayerGroupSpec, layer_id: int, lb: _LayerBuffer,
                positions: np.ndarray, bad: torch.Tensor, expected: torch.Tensor, found: torch.Tensor) -> None:
        rows, heads = torch.nonzero(bad, as_tuple=True)
        self.num_integrity_errors += int(rows.numel())
        self.errors_by_request[request_id] += int(rows.numel())
        tpb = self.layout.tokens_per_block
        for row, head in zip(rows.tolist(), heads.tolist(), strict=True):
            if len(self.issues) >= MAX_RECORDED_ISSUES:
                break
            p = int(positions[row])
            where = Coordinate(request_id, p, layer_id, lb.buffer.role, lb.first_head + head)
            self.issues.append(IntegrityIssue(
                request_id, group.layer_group_id, p // tpb, layer_id, lb.buffer.role.value, p, lb.first_head + head,
                bytes(expected[row, head, :8].cpu().tolist()).hex(),
                found_bytes(found[row, head], expected[row, head], self._origins, where)))

    def _issue(self, request_id: int, group: LayerGroupSpec, ordinal: int, layer_id: int, role: str,
               position: int, head: int, what: str) -> None:
        self.num_integrity_errors += 1
        self.errors_by_request[request_id] += 1
        if len(self.issues) < MAX_RECORDED_ISSUES:
            self.issues.append(IntegrityIssue(request_id, group.layer_group_id, ordinal, layer_id, role,
                                              position, head, "-", "-", what))
