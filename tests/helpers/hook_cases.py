"""The values a connector's hooks can be called with in a real runtime, named as cases, and a host
connector that records which cases a run produced.

`kvtool validate` can only catch a defect that shows for some case its scenarios produce; this is
the list those scenarios are checked against (tests/test_validate_coverage.py). A case is named by
what the connector sees, not by the scenario that creates it.
"""

from __future__ import annotations

from kvtool.connectors.host import HostConnectorScheduler, HostConnectorWorker
from kvtool.manager.radix_tree import common_prefix_length
from kvtool.types import BAD_PAGE_INDEX

ASK_CASES = (
    "ask: nothing local, nothing offered",
    "ask: nothing local, blocks offered",
    "ask: local match on a block boundary, more offered",
    "ask: local match mid-block, more offered",
    "ask: local match, nothing more offered",
    "ask: the whole prompt offered (clamped)",
)
SHARING_CASES = (
    "prompts: identical",
    "prompts: the new one is a prefix ending on a block boundary",
    "prompts: the new one is a prefix ending mid-block",
    "prompts: the new one extends one that ended on a block boundary",
    "prompts: the new one extends one that ended mid-block",
    "prompts: the new one extends an earlier prompt and its output",
    "prompts: diverge on a block boundary",
    "prompts: diverge mid-block",
    "prompts: share no first block",
    "prompts: a block of the new one is a block of the earlier one at another position",
    "prompts: identical tokens, another cache salt",
)
CANCEL_CASES = (
    "cancel: the clamped last position",
    "cancel: a head the local cache overtook",
    "cancel: the whole offer",
)
NOT_PRODUCED = {
    "cancel: head and tail of one offer":
        "needs a deferred request whose block-aligned prompt is offered whole while another request commits "
        "its head; no page budget found that defers it in both test models",
}
PAGE_CASES = (
    "alloc: a load follows pages shared with another live request",
    "alloc: a page list holds BAD_PAGE_INDEX",
    "meta: a decode step adds a page",
    "meta: a later chunk arrives as an append-delta",
    "finished: normally",
    "finished: ended early",
    "worker: loads for two requests in one pass",
)
ALL_CASES = ASK_CASES + SHARING_CASES + CANCEL_CASES + PAGE_CASES
"""Cases some scenario must produce; `NOT_PRODUCED` are known gaps, with the reason."""

RECORDED: set[str] = set()
"""Cases seen since the last `RECORDED.clear()` (scenarios run in this process)."""


def sharing_case(new: list[int], old: list[int], tpb: int) -> str:
    """How a new prompt relates to an earlier one (same reuse scope)."""
    c = common_prefix_length(new, old)
    if c == len(new) == len(old):
        return "prompts: identical"
    if c == len(new):
        return "prompts: the new one is a prefix " + ("ending on a block boundary" if c % tpb == 0
                                                      else "ending mid-block")
    if c == len(old):
        return "prompts: the new one extends one that " + ("ended on a block boundary" if c % tpb == 0
                                                           else "ended mid-block")
    if c < tpb:
        return "prompts: share no first block"
    return "prompts: diverge " + ("on a block boundary" if c % tpb == 0 else "mid-block")


def moved_block(new: list[int], old: list[int], tpb: int) -> bool:
    """A full block of `new` equals a full block of `old` at a different ordinal."""
    old_blocks = {tuple(old[j * tpb:(j + 1) * tpb]): j for j in range(len(old) // tpb)}
    return any(old_blocks.get(tuple(new[i * tpb:(i + 1) * tpb]), i) != i for i in range(len(new) // tpb))


class RecordingScheduler(HostConnectorScheduler):
    """The host connector, recording the case of every call it receives."""

    def __init__(self, llm_args) -> None:
        super().__init__(llm_args)
        self._seen: list[tuple[str | None, list[int], int]] = []   # (salt, tokens, prompt length)
        self._asked: dict[int, tuple[int, int, int]] = {}           # request -> (computed, offered, prompt_len)
        self._cancels: dict[int, list[tuple[int, int]]] = {}
        self._live_pages: dict[int, dict[int, list[int]]] = {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        n, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        tpb, prompt = self.tokens_per_block, request.prompt_token_ids
        if num_computed_tokens == 0:
            RECORDED.add("ask: nothing local, " + ("blocks offered" if n else "nothing offered"))
        elif n == 0:
            RECORDED.add("ask: local match, nothing more offered")
        else:
            RECORDED.add("ask: local match " + ("on a block boundary" if num_computed_tokens % tpb == 0
                                                else "mid-block") + ", more offered")
        if n and num_computed_tokens + n >= len(prompt):
            RECORDED.add("ask: the whole prompt offered (clamped)")
        for salt, old, old_prompt_len in self._seen:
            if salt != request.cache_salt:
                if old[:old_prompt_len] == prompt:
                    RECORDED.add("prompts: identical tokens, another cache salt")
                continue
            RECORDED.add(sharing_case(prompt, old[:old_prompt_len], tpb))
            if len(old) > old_prompt_len and common_prefix_length(prompt, old) == len(old) < len(prompt):
                RECORDED.add("prompts: the new one extends an earlier prompt and its output")
            if moved_block(prompt, old, tpb):
                RECORDED.add("prompts: a block of the new one is a block of the earlier one at another position")
        self._seen.append((request.cache_salt, list(prompt), len(prompt)))
        self._asked[request.request_id] = (num_computed_tokens, n, len(prompt))
        return n, is_async

    def cancel_load(self, request, start, end):
        computed, offered, prompt_len = self._asked.get(request.request_id, (0, 0, 0))
        offer_end = computed + offered
        cancels = self._cancels.setdefault(request.request_id, [])
        cancels.append((start, end))
        if (start, end) == (computed, offer_end):
            RECORDED.add("cancel: the whole offer")
        elif start == prompt_len - 1 and end == offer_end:
            RECORDED.add("cancel: the clamped last position")
        elif start == computed:
            RECORDED.add("cancel: a head the local cache overtook")
        if len(cancels) > 1 and {c[0] for c in cancels} >= {computed} and any(c[1] == offer_end for c in cancels):
            RECORDED.add("cancel: head and tail of one offer")
        super().cancel_load(request, start, end)

    def update_state_after_alloc_by_layer_group(self, request, block_ids_by_layer_group):
        pages = [list(p) for p in block_ids_by_layer_group]
        if any(BAD_PAGE_INDEX in p for p in pages):
            RECORDED.add("alloc: a page list holds BAD_PAGE_INDEX")
        computed, offered, _ = self._asked.get(request.request_id, (0, 0, 0))
        shared_blocks = computed // self.tokens_per_block
        if offered and shared_blocks and any(
                other[g][:shared_blocks] == p[:shared_blocks] for other in self._live_pages.values()
                for g, p in enumerate(pages) if g < len(other) and len(other[g]) >= shared_blocks):
            RECORDED.add("alloc: a load follows pages shared with another live request")
        self._live_pages[request.request_id] = pages
        super().update_state_after_alloc_by_layer_group(request, block_ids_by_layer_group)

    def build_connector_meta(self, scheduler_output):
        for data in scheduler_output.cached_requests:
            grew = any(len(p) for p in data.new_block_ids_by_layer_group)
            if data.num_scheduled_tokens == 1 and grew and data.computed_position % self.tokens_per_block == 0:
                RECORDED.add("meta: a decode step adds a page")
            elif data.num_scheduled_tokens > 1:
                RECORDED.add("meta: a later chunk arrives as an append-delta")
        meta = super().build_connector_meta(scheduler_output)
        if len({t.request_id for t in meta.loads} | set(meta.async_loads)) > 1:
            RECORDED.add("worker: loads for two requests in one pass")
        return meta

    def request_finished_by_layer_group(self, request, cache_block_ids_by_layer_group):
        RECORDED.add("finished: normally" if request.is_finished else "finished: ended early")
        self._live_pages.pop(request.request_id, None)
        self._seen.append((request.cache_salt, request.get_tokens(0), request.prompt_len))
        return super().request_finished_by_layer_group(request, cache_block_ids_by_layer_group)


class RecordingWorker(HostConnectorWorker):
    pass


__all__ = ["ALL_CASES", "RECORDED", "RecordingScheduler", "RecordingWorker"]
