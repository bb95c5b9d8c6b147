"""What a pass's tokens do to its requests: the computed ones committed to the cache, the sampled
one appended, a decode step's accepted drafts kept and its rejected ones rewound, a request that
reached its output length finished."""

from __future__ import annotations

from kvtool.engine.engine_config import EngineStats
from kvtool.engine.lifecycle import Lifecycle
from kvtool.engine.pass_types import KvBytesModel, PassItem
from kvtool.engine.request_state import RequestState
from kvtool.engine.scheduler import Batch


class PassResults:
    """Applies a pass to its batch's requests (`apply`), and gathers for the iteration's
    `FinishedOrder` each request's length after its rejected drafts (`take_rewinds`: every rank's
    fake engine forgets their prefix hashes)."""

    def __init__(self, fake: KvBytesModel, stats: EngineStats, lifecycle: Lifecycle) -> None:
        self._fake = fake
        self._stats = stats
        self._lifecycle = lifecycle
        self._rewinds: dict[int, int] = {}

    def apply(self, batch: Batch, items: list[PassItem]) -> None:
        by_id = {item.request_id: item for item in items}
        stats = self._stats
        for state, n in batch.context:
            item = by_id[state.request_id]
            kv = state.held_kv
            kv.commit(state.prompt_tokens[kv.num_committed_tokens:item.end])
            stats.recomputed_tokens += max(0, min(item.end, state.recompute_until) - state.position)
            state.position = item.end
            state.progress.set_context_position(item.end)
            stats.computed_tokens += n
            if item.end == state.prompt_len:
                self._produce(state, item)
        for state in batch.generation:
            item = by_id[state.request_id]
            self._accept(state, item)
            self._produce(state, item)
            if item.end > item.sampled_after:      # after the sample, which reads the pass's hashes
                self._rewinds[state.request_id] = item.sampled_after

    def take_rewinds(self) -> dict[int, int]:
        rewinds, self._rewinds = self._rewinds, {}
        return rewinds

    def _accept(self, state: RequestState, item: PassItem) -> None:
        """A decode step's tokens whose KV is now right: the last token and the accepted drafts
        (committed, so the radix tree holds only blocks of tokens that happened); the KV of
        rejected drafts stays in the pages as garbage until overwritten."""
        accepted, state.accepted_drafts = state.accepted_drafts, []
        state.held_kv.commit([state.request.last_token, *accepted])
        for token in accepted:
            state.progress.append_token(token)
        self._stats.computed_tokens += item.end - item.start
        self._stats.generated_tokens += len(accepted)

    def _produce(self, state: RequestState, item: PassItem) -> None:
        if state.request.max_new_tokens > 0:
            state.progress.append_token(self._fake.sample(item))
            self._stats.generated_tokens += 1
        if state.request.is_finished:
            self._lifecycle.finish(state)
        else:
            state.start_generation()
