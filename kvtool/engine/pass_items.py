"""What a pass runs, as the fake engine sees it: one `PassItem` per request of the batch (a decode
step with its drafts), the padding dummies, a received context, the idle pages to verify."""

from __future__ import annotations

from kvtool.engine.drafts import DraftModel
from kvtool.engine.pass_types import PassItem
from kvtool.engine.request_state import Phase, RequestState
from kvtool.engine.scheduler import Batch
from kvtool.manager.kv_cache import KvCache
from kvtool.manager.manager import KvCacheManager


def batch_items(batch: Batch, drafts: DraftModel | None) -> list[PassItem]:
    """The batch's context chunks, then its decode steps."""
    items = []
    for state, n in batch.context:
        samples = state.position + n == state.prompt_len and state.request.max_new_tokens > 0
        items.append(PassItem(state.request_id, state.tokens, state.held_kv.page_indices_by_group(),
                              state.position, state.position + n, samples))
    for state in batch.generation:
        items.append(generation_item(state, drafts))
    return items


def generation_item(state: RequestState, drafts: DraftModel | None) -> PassItem:
    """A decode step: the last token, and with drafts the K drafts after it (the verify pass
    writes KV for all of them; it samples after the last accepted one)."""
    request, length = state.request, state.request.get_num_tokens()
    pages = state.held_kv.page_indices_by_group()
    if not state.num_drafts:
        request.py_draft_tokens = []
        return PassItem(state.request_id, state.tokens, pages, length - 1, length, True)
    assert drafts is not None     # a step has drafts only when the engine has a draft model
    proposed = drafts.propose(state.request_id, length, state.num_drafts)
    request.py_draft_tokens = proposed
    state.accepted_drafts = proposed[:drafts.accepted(state.request_id, length, state.num_drafts)]
    return PassItem(state.request_id, [*state.tokens, *proposed], pages, length - 1, length + len(proposed),
                    True, sample_end=length + len(state.accepted_drafts))


def padding(manager: KvCacheManager, batch: Batch, iteration: int, pad_to: int) -> list[tuple[KvCache, PassItem]]:
    """Dummy requests (negative ids) that pad a generation batch up to `pad_to`, as CUDA-graph
    padding does; fewer when pages run out. The caller closes their caches after the pass."""
    wanted = pad_to - len(batch.generation)
    if not batch.generation or wanted <= 0:
        return []
    dummies = []
    for i in range(wanted):
        request_id = -(iteration * 1000 + i + 1)
        kv = manager.create_kv_cache(request_id, [])
        kv.resume()
        if not kv.resize(1):
            kv.close()
            break
        dummies.append((kv, PassItem(request_id, [0], kv.page_indices_by_group(), 0, 1, False)))
    return dummies


def received_item(state: RequestState) -> PassItem:
    """A generation-only request's context, received from elsewhere: every rank writes it."""
    return PassItem(state.request_id, state.request.get_tokens(), state.held_kv.page_indices_by_group(), 0,
                    state.position, False)


def idle_pages(started: list[RequestState], items: list[PassItem]) -> list[PassItem]:
    """The live requests with complete KV this pass does not run, up to their history: their pages
    must not change (a pass's own requests are checked by its forward, and one that fails in the
    pass may hold pages its loads never filled)."""
    in_pass = {item.request_id for item in items}
    return [PassItem(s.request_id, s.request.get_tokens(), s.kv.page_indices_by_group(), 0, s.kv.history_length,
                     False)
            for s in started
            if s.kv is not None and s.phase in (Phase.CONTEXT, Phase.GENERATION) and s.kv.is_active
            and s.request_id not in in_pass]
