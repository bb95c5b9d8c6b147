"""Deliberately broken connectors, one per check of `kvtool validate`: each fails exactly its check
(the suite proves every check can fail, and for the right reason). All start from the host
connector and break one thing, the way real connectors break."""

from __future__ import annotations

from dataclasses import replace

from kvtool.connector.api import KvCacheConnectorWorker
from kvtool.connectors.host import (
    HostConnectorScheduler,
    HostConnectorWorker,
    ReservingHostScheduler,
    ReservingHostWorker,
)
from kvtool.connectors.metadata import PageTransfer
from kvtool.group_pages import GroupPages
from kvtool.manager.block_keys import ReuseScope, block_key, root_key
from kvtool.types import BAD_PAGE_INDEX


def _async_args(llm_args):
    return replace(llm_args, connector_options={**llm_args.connector_options, "mode": "async"})


class Worker(HostConnectorWorker):
    """The host worker, for schedulers below that break only the scheduling side."""


# integrity: loads every block into the page of the next one (an off-by-one)
class WrongSlotWorker(HostConnectorWorker):
    def load(self, transfers, layer_id=None):
        pages = [t.page for t in transfers]
        shifted = [t._replace(page=pages[(i + 1) % len(pages)]) for i, t in enumerate(transfers)]
        super().load(shifted, layer_id)


# warm-hit: never offers anything (valid, and useless)
class NeverServes(HostConnectorScheduler):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        super().get_num_new_matched_tokens(request, num_computed_tokens)
        self.cancel_load(request, 0, request.prompt_len)
        return 0, False


# integrity under chunked prefill: takes cached requests' page lists as whole lists, not deltas
class ChunkDeltaBug(HostConnectorScheduler):
    def _observe(self, data, is_new, meta):
        tracker = self._trackers.get(data.request_id)
        if tracker is not None and not is_new and data.new_block_ids_by_layer_group:
            old = list(tracker.pages)
            tracker.pages = GroupPages(list(p) + list(old[g] if g < len(old) else ())[len(p):] if p else
                                       (old[g] if g < len(old) else ())
                                       for g, p in enumerate(data.new_block_ids_by_layer_group))
            data = replace(data, new_block_ids_by_layer_group=[[] for _ in data.new_block_ids_by_layer_group])
        super()._observe(data, is_new, meta)


# integrity with VSWA: plans and loads stale blocks too, writing through BAD_PAGE_INDEX (slot -1)
class NoBadSkip(HostConnectorScheduler):
    def _plan(self, tracker, start, end):
        plan = super()._plan(tracker, start, end)
        if plan is None:
            return None
        for group in self.groups:
            for j in range(start // self.tokens_per_block, -(-end // self.tokens_per_block)):
                location = self.lookup(tracker.keys[j], group.layer_group_id)
                if location is not None:
                    plan.setdefault((j, group.layer_group_id), location)
        return plan

    def update_state_after_alloc_by_layer_group(self, request, block_ids_by_layer_group):
        tracker = self._tracker(request.request_id, request.cache_salt)
        planned = dict(tracker.planned)
        super().update_state_after_alloc_by_layer_group(request, block_ids_by_layer_group)
        for (j, g), location in planned.items():
            pages = block_ids_by_layer_group[g] if g < len(block_ids_by_layer_group) else []
            if j < len(pages) and pages[j] == BAD_PAGE_INDEX:
                tracker.pending_loads.append(PageTransfer(request.request_id, g, j, pages[j], location,
                                                          tracker.keys[j]))


class NoBadSkipWorker(HostConnectorWorker):
    def load(self, transfers, layer_id=None):
        # -1 used as an index, as Python allows: the last slot
        fixed = [t._replace(page=self.layout.group(t.layer_group_id).regions[0].num_slots - 1)
                 if t.page == BAD_PAGE_INDEX else t for t in transfers]
        super().load(fixed, layer_id)


# holds-nothing: never unpins an entry, so cancelled and finished offers stay pinned forever
class PinLeak(HostConnectorScheduler):
    def unpin(self, location):
        pass


# integrity after deferral: forgets pending offers at every iteration (serving only same-iteration deliveries)
class ForgetsOnDeferral(HostConnectorScheduler):
    def build_connector_meta(self, scheduler_output):
        meta = super().build_connector_meta(scheduler_output)
        for tracker in self._trackers.values():
            if tracker.offer is not None and not tracker.pages:
                for location in tracker.planned.values():
                    self.unpin(location)
                tracker.planned, tracker.offer = {}, None
        return meta


# integrity with the clamp: a cancelled tail is taken as the whole offer cancelled
class DropsOfferOnTailCancel(HostConnectorScheduler):
    def cancel_load(self, request, start, end):
        tracker = self._trackers.get(request.request_id)
        if tracker is not None and tracker.offer is not None and end == tracker.offer[1] and start > tracker.offer[0]:
            start = tracker.offer[0]
        super().cancel_load(request, start, end)


# integrity with an overtaken head: serves the delivered pages from the entries of the cancelled head
class HeadShift(HostConnectorScheduler):
    def update_state_after_alloc_by_layer_group(self, request, block_ids_by_layer_group):
        tracker = self._tracker(request.request_id, request.cache_salt)
        head_cancelled = tracker.offer is not None and any(s <= tracker.offer[0] < e for s, e in tracker.cancelled)
        first = tracker.offer[0] // self.tokens_per_block if tracker.offer else 0
        super().update_state_after_alloc_by_layer_group(request, block_ids_by_layer_group)
        if head_cancelled:
            tracker.pending_loads = [t._replace(location=self.lookup(tracker.keys[first + i], t.layer_group_id) or
                                             t.location) for i, t in enumerate(tracker.pending_loads)]


# load-completes: answers asynchronously and never reports a load finished
class NeverFinishesLoad(HostConnectorScheduler):
    def __init__(self, llm_args):
        super().__init__(_async_args(llm_args))


class NeverFinishesLoadWorker(HostConnectorWorker):
    def __init__(self, llm_args):
        super().__init__(_async_args(llm_args))

    def get_finished(self, finished_gen_req_ids, started_loading_req_ids):
        saved, _ = super().get_finished(finished_gen_req_ids, started_loading_req_ids)
        self._loading.clear()
        return saved, []


# finished-ids: reports every finished save twice
class AsyncScheduler(HostConnectorScheduler):
    def __init__(self, llm_args):
        super().__init__(_async_args(llm_args))


class RepeatsFinishedWorker(HostConnectorWorker):
    def __init__(self, llm_args):
        super().__init__(_async_args(llm_args))
        self._reported: list[int] = []

    def get_finished(self, finished_gen_req_ids, started_loading_req_ids):
        saved, loaded = super().get_finished(finished_gen_req_ids, started_loading_req_ids)
        repeated, self._reported = self._reported, list(saved)
        return saved + repeated, loaded


# survives-hook-failure: keeps the loads of a pass that failed and replays them into the next pass
class StaleAfterFailureWorker(HostConnectorWorker):
    def __init__(self, llm_args):
        super().__init__(llm_args)
        self._unfinished: list[PageTransfer] = []

    def start_load_kv(self, stream):
        self._unfinished += self.meta.loads
        if self._unfinished:
            self.load(self._unfinished)

    def wait_for_save(self, stream):
        self._unfinished = []
        super().wait_for_save(stream)


# integrity (failed requests): every pass that loads something raises, so every warm request FAILS
class LoadRaisesWorker(HostConnectorWorker):
    def start_load_kv(self, stream):
        if self.meta.loads:
            raise RuntimeError("cannot reach the store")
        super().start_load_kv(stream)


# survives-hook-failure (unlanded saves): keeps the index entries of a failed pass's saves, whose bytes
# never landed (the bug the reference host connector had): a later request on that prompt loads garbage
class IndexesUnlandedSaves(HostConnectorScheduler):
    def discard(self, key, layer_group_id, location):
        pass


# survives-hook-failure (unlanded saves, load raises): the same stale index over a store that, like a
# dict, refuses an entry never written: a later request on that prompt fails instead of loading garbage
class RefusesUnwrittenWorker(HostConnectorWorker):
    def __init__(self, llm_args):
        super().__init__(llm_args)
        self._written: set = set()

    def save(self, transfers, layer_id=None):
        super().save(transfers, layer_id)
        self._written.update(t.location for t in transfers)

    def load(self, transfers, layer_id=None):
        missing = [t.location for t in transfers if t.location not in self._written]
        if missing:
            raise KeyError(f"store entry {missing[0]} was never written")
        super().load(transfers, layer_id)


# answers-in-contract: answers (0, True) for prompts shorter than a block
class ZeroAsync(HostConnectorScheduler):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.prompt_len < self.tokens_per_block:
            return 0, True
        return super().get_num_new_matched_tokens(request, num_computed_tokens)


# salt-isolation: keys blocks by their tokens only, ignoring cache_salt
class SaltBlind(HostConnectorScheduler):
    def _tracker(self, request_id, cache_salt):
        tracker = super()._tracker(request_id, None)
        tracker.scope_key = root_key(ReuseScope())
        return tracker


# integrity (local match): assumes the local match ends on a block boundary, so with a match that
# ends inside a block it plans from the next boundary and answers a count that starts there
class AssumesAlignedMatch(HostConnectorScheduler):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        aligned = -(-num_computed_tokens // self.tokens_per_block) * self.tokens_per_block
        return super().get_num_new_matched_tokens(request, aligned)


# integrity (moved blocks): keys a block by its own tokens, not chained to the blocks before it
class UnchainedKeys(HostConnectorScheduler):
    def _tracker(self, request_id, cache_salt):
        tracker = super()._tracker(request_id, cache_salt)
        tracker.extend_keys = lambda tpb, t=tracker: _extend_unchained(t, tpb)
        return tracker


def _extend_unchained(tracker, tokens_per_block):
    for j in range(len(tracker.keys), len(tracker.tokens) // tokens_per_block):
        tracker.keys.append(block_key(tracker.scope_key,
                                      tracker.tokens[j * tokens_per_block:(j + 1) * tokens_per_block]))


# integrity (multi-turn): plans a finished request's asynchronous save at request_finished, counting
# its last sampled token as written (its KV was never computed), and hands it to the worker in the
# next iteration's metadata (the design, and the bug, the reference host-async connector once had)
class SavesUnwrittenAnswer(HostConnectorScheduler):
    def __init__(self, llm_args):
        super().__init__(_async_args(llm_args))
        self._late_saves = {}

    def _observe(self, data, is_new, meta):
        super()._observe(data, is_new, meta)
        meta.async_saves.pop(data.request_id, None)     # nothing saved in the background while it runs
        self._saving_in_background.discard(data.request_id)

    def request_finished_by_layer_group(self, request, cache_block_ids_by_layer_group):
        tracker = self._trackers.get(request.request_id)
        kept = super().request_finished_by_layer_group(request, cache_block_ids_by_layer_group)
        if tracker is None or not request.is_finished:
            return kept    # a load still in flight keeps the pages of a request that ended early
        tracker.pages = GroupPages(cache_block_ids_by_layer_group)
        tracker.tokens = request.get_tokens(0)
        tracker.extend_keys(self.tokens_per_block)
        saves = self._save_blocks(tracker, range(len(tracker.tokens) // self.tokens_per_block))
        if saves:
            self._late_saves[request.request_id] = saves
        return bool(saves)

    def build_connector_meta(self, scheduler_output):
        meta = super().build_connector_meta(scheduler_output)
        meta.async_saves.update(self._late_saves)
        self._late_saves = {}
        return meta


class AsyncWorker(HostConnectorWorker):
    """Starts the background saves its metadata carries at start_load_kv (pages held meanwhile)."""

    def __init__(self, llm_args):
        super().__init__(_async_args(llm_args))

    def start_load_kv(self, stream):
        for request_id, transfers in self.meta.async_saves.items():
            self._saving[request_id] = self._background().submit(self.save, transfers)
        super().start_load_kv(stream)

    def wait_for_save(self, stream):
        if self.meta.saves:
            self.save(self.meta.saves)


# integrity (final-pass blocks): copies each pass's saves one pass late, at the next start_load_kv,
# without asking the runtime to keep the pages: the blocks a request completes in its last pass are
# copied after their pages were released (while it runs on, its pages are still its own)
class DefersSavesWorker(HostConnectorWorker):
    def __init__(self, llm_args):
        super().__init__(llm_args)
        self._late: list[PageTransfer] = []

    def start_load_kv(self, stream):
        late, self._late = self._late, []
        if late:
            self.save(late)
        super().start_load_kv(stream)

    def wait_for_save(self, stream):
        self._late += self.meta.saves


# finished-ids (a save never reported): request_finished answers True for every request with saves
# in the background, and get_finished never names them
class NeverReportsSaveWorker(HostConnectorWorker):
    def __init__(self, llm_args):
        super().__init__(_async_args(llm_args))

    def get_finished(self, finished_gen_req_ids, started_loading_req_ids):
        _, loaded = super().get_finished(finished_gen_req_ids, started_loading_req_ids)
        return [], loaded


# registration: refuses every layout
class LayoutRejecter(HostConnectorWorker):
    def register_kv_cache_layout(self, layout):
        raise RuntimeError("this worker cannot take a layout")


# reservations (main's V2): the worker never reports its prefix loads, so none retires and every
# reservation stays held
class NeverReportsPrefixLoadsWorker(ReservingHostWorker):
    def get_finished_prefix_loads(self):
        super().get_finished_prefix_loads()
        return []


BROKEN = {  # check -> (scheduler class, worker class)
    "integrity": ("HostConnectorScheduler", "WrongSlotWorker"),
    "warm-hit": ("NeverServes", "Worker"),
    "integrity (chunked prefill)": ("ChunkDeltaBug", "Worker"),
    "integrity (VSWA, slot -1)": ("NoBadSkip", "NoBadSkipWorker"),
    "holds-nothing": ("PinLeak", "Worker"),
    "integrity (deferral)": ("ForgetsOnDeferral", "Worker"),
    "integrity (clamp)": ("DropsOfferOnTailCancel", "Worker"),
    "integrity (overtaken head)": ("HeadShift", "Worker"),
    "integrity (local match)": ("AssumesAlignedMatch", "Worker"),
    "integrity (moved blocks)": ("UnchainedKeys", "Worker"),
    "integrity (multi-turn)": ("SavesUnwrittenAnswer", "AsyncWorker"),
    "integrity (final-pass blocks)": ("HostConnectorScheduler", "DefersSavesWorker"),
    "integrity (failed requests)": ("HostConnectorScheduler", "LoadRaisesWorker"),
    "load-completes": ("NeverFinishesLoad", "NeverFinishesLoadWorker"),
    "finished-ids": ("AsyncScheduler", "RepeatsFinishedWorker"),
    "survives-hook-failure": ("HostConnectorScheduler", "StaleAfterFailureWorker"),
    "survives-hook-failure (unlanded saves)": ("IndexesUnlandedSaves", "Worker"),
    "survives-hook-failure (unlanded saves, load raises)": ("IndexesUnlandedSaves", "RefusesUnwrittenWorker"),
    "answers-in-contract": ("ZeroAsync", "Worker"),
    "salt-isolation": ("SaltBlind", "Worker"),
    "registration": ("HostConnectorScheduler", "LayoutRejecter"),
    "reservations": ("ReservingHostScheduler", "NeverReportsPrefixLoadsWorker"),
}
RUNTIME_OF = {"reservations": "trtllm-v2"}
"""The runtime a broken connector's check exists under, where not the default (release) one."""

__all__ = ["BROKEN", "KvCacheConnectorWorker", "ReservingHostScheduler"]   # named by BROKEN
