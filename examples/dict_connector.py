"""A minimal, correct KV cache connector: blocks kept in a dict in host memory.

Written against TensorRT-LLM's connector API, for its V1 manager (one pool tensor, flat block ids)
and for KVCacheManagerV2 (layer groups) alike, so it runs unchanged under `kvtool validate --compat
trtllm` and, without TensorRT-LLM, on kvtool's own identical API, under every runtime:

    kvtool validate examples/dict_connector.py:DictConnectorScheduler:DictConnectorWorker

The rules it follows (each one a check of `kvtool validate`):
- A block's key chains the salt and every token up to the block's end (SHA-256), so equal keys
  mean equal prefixes; a block is offered only when every layer group holds it.
- Page lists are one list per layer group (position = group id), one entry per block ordinal;
  an entry of BAD_PAGE_INDEX (-1) has no page: `valid_page_slots` skips it, `slot_tensor` refuses it.
- An offer leaves the last prompt token to compute (V1 refuses one that covers the whole prompt;
  V2 would cut it there anyway).
- Loads go into the pages of the offer that is left after `cancel_load` trimmed it (release V2).
- V1 calls the flat hooks with pool-wide block ids of its one pool (`register_kv_caches`), V2 the
  per-layer-group ones: the flat forms are the one-group case of the grouped ones.
- `computed_position` excludes what the connector loads (its loads are synchronous; after an
  asynchronous load the first report includes the loaded tokens); a pass saves each block it completes
  (later prefill chunks and decode steps arrive in `cached_requests` as append-deltas).
- A save counts as stored once its pass is over: at the next `build_connector_meta`, or when its
  request finished (`request_finished` comes after the request's last pass, so a prompt saved in
  the last pass before an idle engine is served to the next request); the saves of a request that
  ended early (not `is_finished`: kvtool's runtime ends a request whose pass failed that way) may
  not have landed and are forgotten.
- The store lives in the worker object: no longer than one engine. Each rank keeps its own shard.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

try:   # TensorRT-LLM's modules (real, or kvtool's under --compat trtllm)
    from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import (
        KvCacheConnectorScheduler,
        KvCacheConnectorWorker,
    )
    from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_layout import valid_page_slots
except ImportError:
    from kvtool.connector import KvCacheConnectorScheduler, KvCacheConnectorWorker, valid_page_slots

Move = tuple  # (block key, layer group id, page index)


@dataclass
class DictMetadata:
    loads: list[Move] = field(default_factory=list)
    saves: list[Move] = field(default_factory=list)


@dataclass
class _Request:
    salt: str | None
    tokens: list[int] = field(default_factory=list)
    pages: list[list[int]] = field(default_factory=list)
    offer: list[int] | None = None     # [start, end) still to load, trimmed by cancel_load
    next_block: int = 0                # blocks before it are saved, loaded or computed locally


def block_keys(salt: str | None, tokens: list[int], tokens_per_block: int) -> list[bytes]:
    """One chained key per full block of `tokens`."""
    key, keys = hashlib.sha256((salt or "").encode()).digest(), []
    for start in range(0, len(tokens) - tokens_per_block + 1, tokens_per_block):
        block = b"".join(t.to_bytes(4, "little") for t in tokens[start:start + tokens_per_block])
        key = hashlib.sha256(key + block).digest()
        keys.append(key)
    return keys


class DictConnectorScheduler(KvCacheConnectorScheduler):
    def __init__(self, llm_args) -> None:
        super().__init__(llm_args)
        self.tokens_per_block = llm_args.kv_cache_config.tokens_per_block
        self._stored: dict[bytes, set[int]] = {}       # key -> layer groups holding it
        self._num_groups = 0
        self._requests: dict[int, _Request] = {}
        self._loads: list[Move] = []
        self._unlanded: dict[int, list[Move]] = {}     # the last metadata's saves, per request

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        tpb = self.tokens_per_block
        if num_computed_tokens % tpb:                   # a partial local block: not served (a miss)
            return 0, False
        keys = block_keys(request.cache_salt, request.get_tokens(0), tpb)[num_computed_tokens // tpb:]
        hits = 0
        while hits < len(keys) and self._num_groups and len(self._stored.get(keys[hits], ())) == self._num_groups:
            hits += 1
        end = min(num_computed_tokens + hits * tpb, request.prompt_len - 1)
        if end <= num_computed_tokens:
            return 0, False
        self._track(request).offer = [num_computed_tokens, end]
        return end - num_computed_tokens, False

    def cancel_load(self, request, start, end):
        offer = self._track(request).offer
        if offer and start <= offer[0]:
            offer[0] = max(offer[0], end)               # an overtaken head
        elif offer:
            offer[1] = min(offer[1], start)             # a clamped or refused tail

    def update_state_after_alloc(self, request, block_ids):             # V1: one pool, flat ids
        self.update_state_after_alloc_by_layer_group(request, [block_ids])

    def update_state_after_alloc_by_layer_group(self, request, block_ids_by_layer_group):
        self._num_groups = len(block_ids_by_layer_group)
        tracked = self._track(request)
        if not tracked.offer or tracked.offer[0] >= tracked.offer[1]:
            return
        tpb, (start, end) = self.tokens_per_block, tracked.offer
        end = min(end, start + request.py_num_connector_matched_tokens)   # what the runtime committed to load
        last = -(-end // tpb)                          # a clamped tail ends inside a stored block: load it whole
        keys = block_keys(tracked.salt, request.get_tokens(0)[:last * tpb], tpb)
        for group, pages in enumerate(block_ids_by_layer_group):
            self._loads += [(keys[j], group, page) for j, page in valid_page_slots(pages) if start // tpb <= j < last]

    def build_connector_meta(self, scheduler_output):
        for moves in self._unlanded.values():         # the pass that carried them is over
            for key, group, _ in moves:
                self._stored.setdefault(key, set()).add(group)
        meta, self._loads = DictMetadata(loads=self._loads), []
        for data, is_new in [(d, True) for d in scheduler_output.new_requests] + \
                            [(d, False) for d in scheduler_output.cached_requests]:
            meta.saves += self._completed(data, is_new)
        self._unlanded = {}
        for move in meta.saves:
            self._unlanded.setdefault(move[3], []).append(move[:3])
        meta.saves = [move[:3] for move in meta.saves]
        return meta

    def _completed(self, data, is_new: bool) -> list[tuple]:
        """Saves of the blocks this pass completes: (key, group, page, request id)."""
        tracked = self._requests.get(data.request_id)
        if tracked is None:
            return []
        by_group = data.new_block_ids_by_layer_group or [data.new_block_ids]    # V1 reports flat ids only
        if is_new:
            tracked.tokens, tracked.pages = list(data.new_tokens), [[] for _ in by_group]
        else:
            tracked.tokens += data.new_tokens
        for group, delta in enumerate(by_group):
            tracked.pages[group] += delta
        tpb, start = self.tokens_per_block, data.computed_position
        if is_new and tracked.offer:
            start = max(start, tracked.offer[1])          # loaded blocks are stored already
        # with draft tokens, a block completed by drafts is known (keyed) only once they are accepted
        first = start // tpb if is_new else min(start // tpb, tracked.next_block)
        keys = block_keys(tracked.salt, tracked.tokens, tpb)
        end = min((start + data.num_scheduled_tokens) // tpb, len(keys))
        tracked.next_block = max(tracked.next_block, end)
        return [(keys[j], group, page, data.request_id) for group, pages in enumerate(tracked.pages)
                for j, page in valid_page_slots(pages) if first <= j < end]

    def request_finished(self, request, cache_block_ids):                 # V1
        return self.request_finished_by_layer_group(request, [cache_block_ids])

    def request_finished_by_layer_group(self, request, cache_block_ids_by_layer_group):
        self._requests.pop(request.request_id, None)
        moves = self._unlanded.pop(request.request_id, [])
        if request.is_finished:                        # its last pass is over: servable at once
            for key, group, _ in moves:
                self._stored.setdefault(key, set()).add(group)
        return False          # a request that ended early (its last pass may have failed): forgotten

    def request_reset(self, request):
        self._requests.pop(request.request_id, None)   # its pages are gone; it is reported new again

    def _track(self, request) -> _Request:
        return self._requests.setdefault(request.request_id, _Request(request.cache_salt))


class DictConnectorWorker(KvCacheConnectorWorker):
    def __init__(self, llm_args) -> None:
        super().__init__(llm_args)
        self._blocks: dict[tuple, list] = {}           # (key, group) -> one CPU copy per region

    def register_kv_cache_layout(self, layout):
        self._regions = {group.layer_group_id: group.regions for group in layout.groups}

    def register_kv_caches(self, kv_cache_tensor):                       # V1: block id i is row i
        self._regions = {0: [_PoolRows(kv_cache_tensor)]}

    def start_load_kv(self, stream):
        for key, group, page in self._metadata.loads:
            for region, saved in zip(self._regions[group], self._blocks[(key, group)], strict=True):
                region.slot_tensor(page).copy_(saved)

    def wait_for_layer_load(self, layer_idx, stream):
        pass

    def save_kv_layer(self, layer_idx, stream):
        pass

    def wait_for_save(self, stream):
        stream.synchronize()                           # the pass's KV is written before it is copied
        for key, group, page in self._metadata.saves:
            self._blocks[(key, group)] = [r.slot_tensor(page).to("cpu", copy=True) for r in self._regions[group]]

    def get_finished(self, finished_gen_req_ids, started_loading_req_ids):
        return [], []


class _PoolRows:
    """V1's pool tensor seen as one region: page `i` is row `i` (`[num_layers, kv_factor, block_size]`)."""

    def __init__(self, tensor) -> None:
        self._tensor = tensor

    def slot_tensor(self, page):
        if not 0 <= page < self._tensor.shape[0]:
            raise IndexError(f"block id {page} outside [0, {self._tensor.shape[0]})")
        return self._tensor[page]
