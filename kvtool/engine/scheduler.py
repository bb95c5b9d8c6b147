"""The scheduler: token budget, batch size, chunked prefill, deferral, and the three phases.

Generation requests go first (one token each), then running prefills, then new requests in
arrival order. For a new request, on the manager's own seam:

1. Ask (cache still suspended): once per request, memoising the absolute offer end. The offer is
   clamped to `prompt_len - 1` (the first generation step needs the last prompt position's
   activations) and the dropped tail is cancelled.
2. Reserve (after `resume`, since resize needs ACTIVE): when the offer reaches past the local
   match, SWA scratch reuse goes off and capacity and history move together to the offer end. On
   failure the offer is cancelled and the request computes locally.
3. Deliver (on the final batch, before the forward pass): the head the local match overtook is
   cancelled, the rest recorded as external tokens (0 <= recorded <= position), the connector told
   which pages back the request.

A request whose first chunk cannot get pages is deferred: its cache is closed and it is prepared
again next iteration (its local match may have grown); the connector is not asked again.
"""

from __future__ import annotations


from dataclasses import dataclass, field
from typing import Callable

from kvtool.connector.runtime import ConnectorRuntime
from kvtool.engine.admission import OutputReservation
from kvtool.engine.drafts import DraftModel
from kvtool.engine.events import Ask, Cancel, Deliver, LoadStarted, Reserve
from kvtool.engine.request_state import FailureReason, Offer, Phase, RequestState
from kvtool.errors import LogicError
from kvtool.manager.block_keys import ReuseScope
from kvtool.manager.manager import KvCacheManager


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int = 64
    max_num_tokens: int = 8192
    chunk_size: int | None = None
    local_reuse: bool = True
    reserve_outputs: bool = False
    """Admit a request only when every admitted one can still grow to prompt + max_new_tokens
    (`kvtool.engine.admission`); greedy admission (False) may fill the pool with requests that
    all still grow, and the replay stops with OutOfPagesError unless `pause_to_grow`."""
    pause_to_grow: bool = False
    """TensorRT-LLM's MAX_UTILIZATION: admit greedily; a running request that cannot grow takes
    the pages of the running request started last, which is paused (its allocation released, its
    committed blocks left in the radix tree) and runs again from the start later."""


@dataclass
class Batch:
    context: list[tuple[RequestState, int]] = field(default_factory=list)
    generation: list[RequestState] = field(default_factory=list)
    first_chunks: list[RequestState] = field(default_factory=list)
    received: list[RequestState] = field(default_factory=list)
    """Generation-only requests admitted this iteration: their context arrives from elsewhere."""
    loading_started: list[RequestState] = field(default_factory=list)
    """Requests scheduled this iteration that left the batch to load asynchronously (their load
    starts with this iteration's `start_load_kv`)."""

    @property
    def num_requests(self) -> int:
        return len(self.context) + len(self.generation)

    def drop(self, state: RequestState) -> None:
        self.context = [(s, n) for s, n in self.context if s is not state]
        self.generation = [s for s in self.generation if s is not state]
        self.first_chunks = [s for s in self.first_chunks if s is not state]


class Scheduler:
    def __init__(self, manager: KvCacheManager, config: SchedulerConfig, connector: ConnectorRuntime | None,
                 fail: Callable[[RequestState, FailureReason], None],
                 emit: Callable[..., None] = lambda kind, **fields: None,
                 pause: Callable[[RequestState], None] | None = None, drafts: DraftModel | None = None) -> None:
        self.manager = manager
        self.config = config
        self.connector = connector
        self._fail = fail
        self._pause = pause
        self._drafts = drafts
        self._emit = emit
        self.iteration = 0
        self._reservation = OutputReservation(manager) if config.reserve_outputs else None

    def schedule(self, running: list[RequestState], waiting: list[RequestState], iteration: int,
                 loading: list[RequestState] = ()) -> Batch:
        """One iteration's batch. `loading`: requests holding pages outside the batch (an
        asynchronous load in flight), which output reservation counts as still growing."""
        self.iteration = iteration
        batch = Batch()
        if self._reservation is not None:
            self._reservation.start_pass([*running, *loading])
        alone = not running and not loading
        budget = [self.config.max_num_tokens]
        running = list(running)
        for state in running:
            if state.phase is Phase.GENERATION and self._room(batch, budget):
                drafts = self._num_drafts(state, budget[0])
                if self._grow(state, state.request.get_num_tokens() + drafts, running, batch):
                    state.num_drafts = drafts
                    batch.generation.append(state)
                    budget[0] -= 1 + drafts
        for state in running:
            if state.phase is Phase.CONTEXT:
                n = self._chunk(state.position, state.prompt_len, budget)
                if n and self._room(batch, budget) and self._grow(state, state.position + n, running, batch):
                    batch.context.append((state, n))
                    budget[0] -= n
        for state in waiting:
            if state.request.is_generation_only_request:
                if self._room(batch, budget) and self._admit_generation_only(state):
                    batch.received.append(state)
                    batch.context.append((state, 1))
                    budget[0] -= 1
                continue
            if not self._room(batch, budget):
                break
            n = self._prepare(state, budget, alone and not batch.num_requests)
            if n:
                batch.context.append((state, n))
                batch.first_chunks.append(state)
                budget[0] -= n
            elif self._reservation is not None and state.phase is Phase.WAITING:
                break   # first come, first served: later arrivals do not overtake a deferred one
        for state in list(batch.first_chunks):
            self._deliver(state, batch)
        return batch

    def _num_drafts(self, state: RequestState, budget: int) -> int:
        """Drafts of this decode step: K, fewer near the end of its output or of the token budget."""
        if self._drafts is None:
            return 0
        request = state.request
        return min(self._drafts.drafts_for(request.max_new_tokens, request.num_generated_tokens), budget - 1)

    def _grow(self, state: RequestState, capacity: int, running: list[RequestState], batch: Batch) -> bool:
        """Resize a running request's cache; with `pause_to_grow`, pause the running requests
        started last (not yet in this batch) one by one until it fits. False: it sits this
        iteration out."""
        while not state.kv.resize(capacity):
            victim = self._victim(state, running, batch) if self.config.pause_to_grow else None
            if victim is None:
                return False
            self._pause(victim)
        return True

    @staticmethod
    def _victim(state: RequestState, running: list[RequestState], batch: Batch) -> RequestState | None:
        """The running request started last that this batch does not hold yet (never `state`)."""
        scheduled = {s.request_id for s, _ in batch.context} | {s.request_id for s in batch.generation}
        candidates = [s for s in running if s is not state and s.request_id not in scheduled
                      and s.phase in (Phase.CONTEXT, Phase.GENERATION)]
        return max(candidates, key=lambda s: s.arrival_order, default=None)

    # ---- phases ------------------------------------------------------------------------------
    def _prepare(self, state: RequestState, budget: list[int], alone: bool) -> int:
        """Create, ask, resume, reserve and size the first chunk; 0 when deferred or failed.
        `alone`: nothing else runs, so output reservation cannot refuse it."""
        request = state.request
        prompt = request._prompt_view()
        scope = ReuseScope.from_cache_salt(request.cache_salt)
        kv = self.manager.create_kv_cache(request.request_id, prompt[:-1] if self.config.local_reuse else [],
                                          scope, expected_prompt_length=request.prompt_len)
        state.kv = kv
        local_end = kv.num_committed_tokens
        if not state.asked and not self._ask(state, local_end):
            return 0
        kv.resume()
        position = self._reserve(state, local_end)
        if state.phase is Phase.FAILED:
            return 0
        n = self._chunk(position, request.prompt_len, budget)
        if not n or not kv.resize(position + n) or not self._admits(state, alone):
            kv.close()
            state.kv = None
            state.num_deferrals += 1
            return 0
        state.admit(kv, position, local_end)
        return n

    def _admits(self, state: RequestState, alone: bool) -> bool:
        return self._reservation is None or self._reservation.admit(state, alone)

    def _admit_generation_only(self, state: RequestState) -> bool:
        """Pages for the whole prompt, whose KV a context server sent (all but the last position,
        which the first pass computes to sample the first token). The connector is never asked."""
        kv = self.manager.create_kv_cache(state.request_id, [], expected_prompt_length=state.prompt_len)
        kv.resume()
        if not kv.resize(state.prompt_len):
            kv.close()
            state.num_deferrals += 1
            return False
        state.admit(kv, state.prompt_len - 1, 0)
        return True

    def _ask(self, state: RequestState, local_end: int) -> bool:
        """Ask the connector once; memoise the absolute, clamped offer. False: the request failed."""
        state.asked = True
        if self.connector is None or state.request.is_generation_only_request or state.request.is_dummy_request:
            return True
        answer = self.connector.ask(state.request, local_end)
        if answer is None:
            self._fail(state, FailureReason.ASK_RAISED)
            return False
        end = local_end + answer.num_tokens
        clamped = min(end, state.prompt_len - 1)
        self._emit(Ask, request_id=state.request_id, num_computed_tokens=local_end,
                   num_offered_tokens=max(clamped - local_end, 0), is_async=answer.is_async)
        if answer.num_tokens == 0:
            return True
        state.offer = Offer(local_end, clamped, answer.is_async)
        if end > clamped:
            self.cancel(state, clamped, end)
        if clamped <= local_end:
            state.offer.closed = True
        return True

    def _reserve(self, state: RequestState, local_end: int) -> int:
        offer, kv = state.offer, state.kv
        if offer is None or offer.closed or offer.end <= local_end:
            return local_end
        ok = kv.resize(max(kv.capacity, offer.end), offer.end, scratch_reuse=False)
        self._emit(Reserve, request_id=state.request_id, start=offer.start, end=offer.end, ok=ok)
        if ok:
            return offer.end
        offer.closed = True
        self.cancel(state, offer.start, offer.end)
        return local_end

    def _deliver(self, state: RequestState, batch: Batch) -> None:
        offer, kv = state.offer, state.kv
        if offer is not None and not offer.closed:
            committed = min(kv.num_committed_tokens, offer.end)
            self.cancel(state, offer.start, committed)
            recorded = offer.end - committed
            if not 0 <= recorded <= state.position:
                raise LogicError(f"request {state.request_id}: recorded {recorded} external tokens at "
                                 f"position {state.position}")
            offer.closed = True
            state.num_external = recorded
            state.request.py_num_connector_matched_tokens = recorded
            state.num_local_hit = committed
            state.delivered_at = self.iteration
            self._emit(Deliver, request_id=state.request_id, num_external=recorded, num_local_hit=committed)
            if recorded:
                self._emit(LoadStarted, request_id=state.request_id, num_tokens=recorded, is_async=offer.is_async)
        if self.connector is None:
            return
        state.seen_by_connector = True
        if not self.connector.after_alloc(state.request, kv.page_indices_by_group()):
            batch.drop(state)
            self._fail(state, FailureReason.ALLOC_HOOK_RAISED)
            return
        if state.num_external and offer.is_async:
            batch.drop(state)
            batch.loading_started.append(state)
            state.start_transmission(self.iteration)
            self.connector.start_async_load(state.request_id)

    # ---- helpers -----------------------------------------------------------------------------
    def cancel(self, state: RequestState, start: int, end: int) -> None:
        """Hand tokens [start, end) of the request's offer back to the connector (`cancel_load`)."""
        self.connector.cancel(state.request, start, end)
        if end > start:
            self._emit(Cancel, request_id=state.request_id, start=start, end=end)

    def _chunk(self, position: int, prompt_len: int, budget: list[int]) -> int:
        n = min(prompt_len - position, budget[0])
        if self.config.chunk_size:
            n = min(n, self.config.chunk_size)
        return max(n, 0)

    def _room(self, batch: Batch, budget: list[int]) -> bool:
        return batch.num_requests < self.config.max_batch_size and budget[0] >= 1
