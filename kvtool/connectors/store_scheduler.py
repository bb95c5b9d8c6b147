"""The scheduler half shared by the block-store connectors.

A store entry is one page of one layer group, keyed by the block's chained hash (the reuse scope,
hence `cache_salt`, is part of the chain) and the layer group. A prefix of P tokens can be served
when every layer group has the entries it needs at that length: every block for full attention,
sink blocks and the live window for sliding groups (the manager's own usability rule).

Loads: exactly the delivered range (the offer minus what the runtime cancelled), only into real
pages. Saves: each full block in the pass that completes it, while its pages are surely valid. In
`async` mode sliding-window groups save that way (their pages go as the window moves on), and
full-attention pages are saved in the background, started by the worker at the end of the pass that
wrote them; `request_finished` answers True while any of them may be in flight, so the runtime
holds the pages until the worker reports the request. (No metadata reaches the workers after a
request's last pass, so a save cannot wait for `request_finished` to be planned.)
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvtool.blocks import num_blocks
from kvtool.connector.api import KvCacheConnectorScheduler, PrefixLoad, RequestData, SchedulerOutput
from kvtool.connector.introspection import Introspection
from kvtool.connector.llm_args import LlmArgs
from kvtool.connector.options import ConnectorOption
from kvtool.connector.request import Request
from kvtool.connectors.metadata import PageTransfer, StoreMetadata
from kvtool.connectors.store_mode import StoreMode, store_mode
from kvtool.group_pages import GroupPages
from kvtool.manager.block_keys import ReuseScope, chain_keys, root_key, tokens_bytes
from kvtool.transfer.registry import AUTO, backend_names
from kvtool.types import BAD_PAGE_INDEX


def _known_backend(name: str) -> None:
    if name != AUTO and name not in backend_names():
        raise ValueError(f"no transfer backend {name!r}; known: {AUTO}, {', '.join(backend_names())}")


STORE_OPTIONS = (
    ConnectorOption("mode", "when blocks move: around the pass (sync), in the background (async), "
                            "or one layer at a time (layerwise)", "sync", tuple(m.value for m in StoreMode)),
    ConnectorOption("backend", "the transfer backend that moves the bytes (see kvtool bench); auto: staged for "
                               "pages on a GPU with PyCUDA, torch otherwise", AUTO, check=_known_backend),
)


@dataclass
class _Tracker:
    request_id: int
    scope_key: bytes
    tokens: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    pages: GroupPages = field(default_factory=GroupPages)
    offer: tuple[int, int] | None = None
    planned: dict[tuple[int, int], Any] = field(default_factory=dict)
    """(ordinal, group) -> location, pinned until loaded or cancelled."""
    cancelled: list[tuple[int, int]] = field(default_factory=list)
    pending_loads: list[PageTransfer] = field(default_factory=list)
    delivered: tuple[int, int] | None = None
    delivered_reported: bool = False
    next_block: int | None = None
    """The first block no save has covered yet (None before the first report)."""
    held_pins: list[Any] = field(default_factory=list)
    """Pins of emitted loads, released once the load has surely run (a later iteration)."""
    loads_emitted_at: int = -1

    def extend_keys(self, tokens_per_block: int) -> None:
        first, end = len(self.keys), len(self.tokens) // tokens_per_block
        if first < end:
            previous = self.keys[-1] if self.keys else self.scope_key
            packed = tokens_bytes(self.tokens[first * tokens_per_block:end * tokens_per_block])
            self.keys.extend(chain_keys(previous, packed, tokens_per_block))


@dataclass
class _Promise:
    """A prefix reservation: [start, end) of a request's prompt, its entries pinned until released."""

    request_id: int
    start: int
    end: int
    planned: dict[tuple[int, int], Any]
    """(ordinal, group) -> location, each pinned once; unpinned when the part holding its block is released."""

    def first_token(self, ordinal: int, tokens_per_block: int) -> int:
        """The position by which a block's entry belongs to a released part (its first token in the promise)."""
        return max(ordinal * tokens_per_block, self.start)


class BlockStoreScheduler(KvCacheConnectorScheduler):
    kvtool_options: ClassVar[tuple[ConnectorOption, ...]] = STORE_OPTIONS   # subclasses add their own

    def __init__(self, llm_args: LlmArgs) -> None:
        super().__init__(llm_args)
        self.tokens_per_block = llm_args.kv_cache_config.tokens_per_block
        self.groups = llm_args.layer_groups
        self.mode = store_mode(llm_args.connector_options)
        self._takes_offers_whole = not llm_args.kv_cache_config.use_kv_cache_manager_v2
        """TensorRT-LLM's V1 takes an offer whole and refuses one that covers the whole prompt (V2
        clamps it and computes the last token itself)."""
        self._trackers: dict[int, _Tracker] = {}
        self._saving_in_background: set[int] = set()
        """Requests with a background save emitted: `request_finished` answers True for them."""
        self._window_of = {g.layer_group_id: g.window_size for g in self.groups}
        self.num_saved_blocks = 0
        self.num_loaded_blocks = 0
        self._num_metas = 0
        self._unlanded: dict[int, list[PageTransfer]] = {}
        """Saves of the latest metadata, per request: indexed at `reserve`, written only if the
        pass that carries them completes."""
        self._promises: dict[int, _Promise] = {}
        """Prefix reservations not fully released, by reservation id."""

    # ---- the store, per connector ------------------------------------------------------------
    @abstractmethod
    def lookup(self, key: bytes, layer_group_id: int) -> Any | None:
        """Location of a valid entry (and mark it used), or None."""

    def contains(self, key: bytes, layer_group_id: int) -> bool:
        """Whether a valid entry exists, without marking it used (a store with a cheaper test
        than `lookup` overrides this)."""
        return self.lookup(key, layer_group_id) is not None

    @abstractmethod
    def reserve(self, key: bytes, layer_group_id: int) -> Any | None:
        """Location to save a new entry into, or None to skip (already stored, or no room)."""

    def pin(self, location: Any) -> None:
        """Keep an entry from eviction until `unpin` (between offer and load)."""

    def unpin(self, location: Any) -> None:
        """Undo one `pin`."""

    def discard(self, key: bytes, layer_group_id: int, location: Any) -> None:
        """Forget an entry `reserve` handed out whose bytes never landed (its pass failed). A store
        that publishes an entry only once its bytes are written (disk) has nothing to undo."""

    def begin_ask(self, keys: list[bytes], first: int) -> None:
        """Called before an ask's `contains`/`lookup` calls on blocks `keys[first:]`: a store
        that answers them from one snapshot (a remote server: one round trip) takes it here."""

    def secure(self, plan: dict[tuple[int, int], Any]) -> dict[tuple[int, int], Any] | None:
        """The plan about to be offered, with locations that stay loadable until loaded or
        cancelled (a remote store fetches the entries here, so that an offer is never broken).
        None when an entry has vanished: the store forgets it and the ask plans again."""
        return plan

    def end_ask(self) -> None:
        """The ask is answered: drop what `begin_ask` took."""

    # ---- the API -----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        tracker = self._tracker(request.request_id, request.cache_salt)
        tracker.tokens = request.get_tokens(0)[:request.prompt_len]
        tracker.extend_keys(self.tokens_per_block)
        first = num_computed_tokens // self.tokens_per_block
        self.begin_ask(tracker.keys, first)
        try:
            while (answer := self._offer(tracker, request, num_computed_tokens, first)) is None:
                pass
            return answer
        finally:
            self.end_ask()

    def _offer(self, tracker: _Tracker, request: Request, num_computed_tokens: int,
               first: int) -> tuple[int, bool] | None:
        """The longest secured offer past `num_computed_tokens`; None when securing it failed
        (ask again: the store has forgotten what vanished)."""
        last = request.prompt_len - 1
        # V1 takes an offer whole and needs the last prompt token left to compute
        secured = self._secure_longest(tracker, num_computed_tokens, first, lambda length: (
            min(length, last) if self._takes_offers_whole else length, min(length, last)))
        if secured is None:
            return None
        length, plan = secured
        if length <= num_computed_tokens:
            return 0, False
        tracker.planned, tracker.offer = plan, (num_computed_tokens, length)
        return length - num_computed_tokens, self.mode is StoreMode.ASYNC

    def _secure_longest(self, tracker: _Tracker, num_computed_tokens: int, first: int,
                        ends: Callable[[int], tuple[int, int]]) -> tuple[int, dict[tuple[int, int], Any]] | None:
        """The longest run of stored blocks from `first` whose plan secures, as (offer end, pinned
        plan); `ends(length)` gives a run's offer end and the end its plan covers. (`num_computed_tokens`,
        {}) when none does; None when securing failed (ask again)."""
        tpb = self.tokens_per_block
        for num_hit_blocks in range(self._stored_run_end(tracker, first), first, -1):
            end, plan_end = ends(num_hit_blocks * tpb)
            plan = self._plan(tracker, num_computed_tokens, plan_end)
            if plan is not None and end > num_computed_tokens:
                plan = self.secure(plan)
                if plan is None:
                    return None
                for location in plan.values():
                    self.pin(location)
                return end, plan
        return num_computed_tokens, {}

    def _stored_run_end(self, tracker: _Tracker, first: int) -> int:
        """The end of the run of blocks from `first` on that every full-attention group holds: no
        plan starting there reaches further (a windowed group may need less; `_plan` decides)."""
        full = [g.layer_group_id for g in self.groups if g.window_size is None]
        for j in range(first, len(tracker.keys)):
            if not all(self.contains(tracker.keys[j], g) for g in full):
                return j
        return len(tracker.keys)

    def _plan(self, tracker: _Tracker, start: int, end: int) -> dict[tuple[int, int], Any] | None:
        """Locations of every entry needed to serve [start, end), or None if one is missing."""
        tpb = self.tokens_per_block
        plan: dict[tuple[int, int], Any] = {}
        for group in self.groups:
            stale = group.stale_range(end, tpb)
            for j in range(start // tpb, num_blocks(end, tpb)):
                if j in stale:
                    continue
                location = self.lookup(tracker.keys[j], group.layer_group_id)
                if location is None:
                    return None
                plan[(j, group.layer_group_id)] = location
        return plan

    # ---- prefix reservations (`main`'s V2) ---------------------------------------------------
    def _promise_prefix(self, request: Request, num_computed_tokens: int, reservation_id: int) -> tuple[int, bool]:
        """`reserve_prefix` (`PrefixReservingScheduler`): promise the longest stored run of whole blocks past
        `num_computed_tokens` that leaves the last prompt token to compute, its entries pinned until released;
        no transfer starts."""
        tracker = self._tracker(request.request_id, request.cache_salt)
        tracker.tokens = request.get_tokens(0)[:request.prompt_len]
        tracker.extend_keys(self.tokens_per_block)
        tpb, last = self.tokens_per_block, request.prompt_len - 1
        self.begin_ask(tracker.keys, num_computed_tokens // tpb)
        try:
            whole = lambda length: (min(length, last) // tpb * tpb,) * 2   # noqa: E731 - the runtime floors to a block
            while (secured := self._secure_longest(tracker, num_computed_tokens, num_computed_tokens // tpb,
                                                   whole)) is None:
                pass
        finally:
            self.end_ask()
        end, plan = secured
        if end <= num_computed_tokens:
            return 0, False
        self._promises[reservation_id] = _Promise(request.request_id, num_computed_tokens, end, plan)
        return end - num_computed_tokens, self.mode is StoreMode.ASYNC

    def _release_promise(self, reservation_id: int, start: int, end: int) -> None:
        """`release_prefix_reservation`: unpin the promise's entries whose blocks begin in [start, end) (unused,
        or loaded on every worker)."""
        promise = self._promises.get(reservation_id)
        if promise is None:
            return
        for (j, g) in [key for key in promise.planned
                       if start <= promise.first_token(key[0], self.tokens_per_block) < end]:
            self.unpin(promise.planned.pop((j, g)))
        if not promise.planned:
            del self._promises[reservation_id]

    def _prefix_loads(self, loads: list[PrefixLoad], meta: StoreMetadata) -> None:
        """The confirmed loads of promises, from the entries each promise pinned (held until released)."""
        tpb = self.tokens_per_block
        for load in loads:
            promise = self._promises[load.reservation_id]
            pages = GroupPages(load.block_ids_by_layer_group)
            tracker = self._tracker(load.request_id, load.cache_salt)
            transfers = [PageTransfer(load.request_id, g, j, pages[g][j], location, tracker.keys[j])
                         for (j, g), location in promise.planned.items()
                         if load.start <= promise.first_token(j, tpb) < load.end and j < len(pages[g])
                         and pages[g][j] != BAD_PAGE_INDEX]
            tracker.delivered, tracker.delivered_reported = (load.start, load.end), False
            self.num_loaded_blocks += len({t.block_ordinal for t in transfers})
            if load.is_async:
                meta.async_prefix_loads[load.reservation_id] = transfers
            else:
                meta.loads.extend(transfers)
                meta.prefix_loads.append(load.reservation_id)

    def cancel_load(self, request: Request, start: int, end: int) -> None:
        tracker = self._trackers.get(request.request_id)
        if tracker is not None:
            tracker.cancelled.append((start, end))

    def update_state_after_alloc(self, request: Request, block_ids: list[int]) -> None:
        self.update_state_after_alloc_by_layer_group(request, GroupPages([block_ids]))

    def update_state_after_alloc_by_layer_group(self, request: Request,   # (a GroupPages from kvtool's runtime)
                                                block_ids_by_layer_group: Sequence[Sequence[int]]) -> None:
        tracker = self._tracker(request.request_id, request.cache_salt)
        tracker.pages = GroupPages(block_ids_by_layer_group)
        if tracker.offer is None:
            return
        start, end = self._delivered(tracker)
        # What the runtime committed to load from us: `main`'s V2 may honour less than the offer
        # and never hand the rest back (it has no cancel_load).
        end = min(end, start + request.py_num_connector_matched_tokens)
        tpb = self.tokens_per_block
        wanted = {(j, g) for g, pages in tracker.pages.items() for j in range(start // tpb, num_blocks(end, tpb))
                  if start < end and j < len(pages) and pages[j] != BAD_PAGE_INDEX}
        loads = []
        for (j, g), location in tracker.planned.items():
            if (j, g) in wanted:
                loads.append(PageTransfer(request.request_id, g, j, tracker.pages[g][j], location, tracker.keys[j]))
                tracker.held_pins.append(location)
            else:
                self.unpin(location)
        tracker.pending_loads.extend(loads)
        tracker.planned = {}
        tracker.delivered = (start, end) if start < end else None
        if tracker.delivered:
            self.num_loaded_blocks += len({t.block_ordinal for t in tracker.pending_loads})
            self.delivered(request.request_id, tracker.delivered, loads)

    def delivered(self, request_id: int, span: tuple[int, int], loads: list[PageTransfer]) -> None:
        """Tokens `span` of the request will be loaded by `loads` (their locations as the store
        planned them): a store of several tiers counts where they come from here."""

    def _delivered(self, tracker: _Tracker) -> tuple[int, int]:
        """The offer minus what was cancelled: cancels always cut its head or its tail."""
        assert tracker.offer is not None   # asked once the request holds an offer
        start, end = tracker.offer
        for c_start, c_end in sorted(tracker.cancelled):
            if c_start <= start:
                start = max(start, c_end)
            elif c_end >= end:
                end = min(end, c_start)
        return start, max(start, end)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StoreMetadata:
        # The previous pass is over: a request it failed was reported through request_finished
        # (which discarded its saves) before this call, so the saves still listed have landed.
        self._unlanded = {}
        self._num_metas += 1
        meta = StoreMetadata()
        self._prefix_loads(scheduler_output.prefix_loads, meta)
        for data in scheduler_output.new_requests:
            self._observe(data, is_new=True, meta=meta)
        for data in scheduler_output.cached_requests:
            self._observe(data, is_new=False, meta=meta)
        for tracker in self._trackers.values():
            if tracker.pending_loads:
                target = (meta.async_loads.setdefault(tracker.request_id, []) if self.mode is StoreMode.ASYNC
                          else meta.loads)
                target.extend(tracker.pending_loads)
                tracker.pending_loads = []
                tracker.loads_emitted_at = self._num_metas
        for save in [*meta.saves, *(t for transfers in meta.async_saves.values() for t in transfers)]:
            self._unlanded.setdefault(save.request_id, []).append(save)
        return meta

    def _observe(self, data: RequestData, is_new: bool, meta: StoreMetadata) -> None:
        tracker = self._trackers.get(data.request_id)
        if tracker is None:
            return
        by_group = data.new_block_ids_by_layer_group or [data.new_block_ids]   # V1 reports flat ids only
        if is_new:
            tracker.tokens = list(data.new_tokens)
            tracker.pages = GroupPages(by_group)
        else:
            tracker.tokens.extend(data.new_tokens)
            tracker.pages = tracker.pages.extended(by_group)
        tracker.extend_keys(self.tokens_per_block)
        if tracker.held_pins and 0 <= tracker.loads_emitted_at < self._num_metas:
            self._release_pins(tracker)
        start = data.computed_position
        if tracker.delivered and not tracker.delivered_reported:
            start = max(start, tracker.delivered[1])
            tracker.delivered_reported = True
        saves = self._completed_blocks(tracker, start, start + data.num_scheduled_tokens)
        if self.mode is not StoreMode.ASYNC:
            meta.saves.extend(saves)
            return
        meta.saves.extend(t for t in saves if self._window_of[t.layer_group_id] is not None)
        background = [t for t in saves if self._window_of[t.layer_group_id] is None]
        if background:
            meta.async_saves.setdefault(tracker.request_id, []).extend(background)
            self._saving_in_background.add(tracker.request_id)

    def _completed_blocks(self, tracker: _Tracker, start: int, end: int) -> list[PageTransfer]:
        """Saves for the full blocks written by the end of this pass and not saved yet: the ones it
        completes, and the ones an earlier verify pass completed with drafts, accepted since (their
        tokens, hence their keys, are known only now)."""
        tpb = self.tokens_per_block
        first = start // tpb if tracker.next_block is None else min(start // tpb, tracker.next_block)
        last = min(end // tpb, len(tracker.keys))
        tracker.next_block = max(tracker.next_block or 0, last)
        return self._save_blocks(tracker, range(first, last))

    def _save_blocks(self, tracker: _Tracker, ordinals: range) -> list[PageTransfer]:
        """A save per real page of each block in `ordinals` whose entry `reserve` hands out: block
        by block, a block's layer groups in order (the order the store's index sees them)."""
        groups = list(tracker.pages.items())
        reserve, keys, request_id = self.reserve, tracker.keys, tracker.request_id
        saves: list[PageTransfer] = []
        for j in ordinals:
            key, before = keys[j], len(saves)
            for g, pages in groups:
                if j < len(pages) and pages[j] != BAD_PAGE_INDEX:
                    location = reserve(key, g)
                    if location is not None:
                        saves.append(PageTransfer(request_id, g, j, pages[j], location, key))
            self.num_saved_blocks += len(saves) > before
        return saves

    def request_finished(self, request: Request, cache_block_ids: list[int]) -> bool:
        return self.request_finished_by_layer_group(request, GroupPages([cache_block_ids]))

    def request_finished_by_layer_group(self, request: Request,
                                        cache_block_ids_by_layer_group: Sequence[Sequence[int]]) -> bool:
        unlanded = self._unlanded.pop(request.request_id, [])
        if not request.is_finished:   # ended early (failed or aborted), maybe in the pass of these saves
            for save in unlanded:
                self.discard(save.key, save.layer_group_id, save.location)
        saving = request.request_id in self._saving_in_background
        self._saving_in_background.discard(request.request_id)
        tracker = self._trackers.pop(request.request_id, None)
        if tracker is not None:
            for location in tracker.planned.values():
                self.unpin(location)
            self._release_pins(tracker)
        # A request that ended early may end while its background load still writes into its
        # pages: they are kept until the worker reports that load landed (as a save).
        loading = self.mode is StoreMode.ASYNC and tracker is not None and tracker.loads_emitted_at >= 0 \
            and not request.is_finished
        return saving or loading

    def _release_pins(self, tracker: _Tracker) -> None:
        for location in tracker.held_pins:
            self.unpin(location)
        tracker.held_pins = []

    # ---- introspection -----------------------------------------------------------------------
    def kvtool_introspection(self) -> Introspection:
        """What `kvtool validate` and `trace run` ask (`kvtool.connector.introspection`): ids of
        requests the connector still holds state for, and block counters."""
        return Introspection(tracked_request_ids=tuple(sorted(self._trackers)),
                             saved_blocks=self.num_saved_blocks, loaded_blocks=self.num_loaded_blocks)

    def _tracker(self, request_id: int, cache_salt: str | None) -> _Tracker:
        if request_id not in self._trackers:
            self._trackers[request_id] = _Tracker(request_id, root_key(ReuseScope.from_cache_salt(cache_salt)))
        return self._trackers[request_id]


class PrefixReservingScheduler(BlockStoreScheduler):
    """A block-store scheduler that takes part in prefix reservations (`main`'s V2): listed before
    the store's scheduler class, `class S(PrefixReservingScheduler, HostConnectorScheduler)`; its
    worker must be a `PrefixReservingWorker` too (TensorRT-LLM refuses one hook without the others)."""

    def reserve_prefix(self, request: Request, num_computed_tokens: int, reservation_id: int) -> tuple[int, bool]:
        return self._promise_prefix(request, num_computed_tokens, reservation_id)

    def release_prefix_reservation(self, request: Request, reservation_id: int, start: int, end: int) -> None:
        self._release_promise(reservation_id, start, end)
