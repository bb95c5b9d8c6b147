"""The scheduler: token budget, batch size, chunked prefill, deferral.

Generation requests go first (one token each, more with drafts), then running prefills, then new
requests in arrival order. Everything about the connector and a request's allocation (when it is
asked, what its first chunk's pages are, what happens once the batch is final) belongs to the
runtime profile's `ConnectorAdmission` (`kvtool.engine.runtimes`), which the scheduler calls at a
waiting request's first chunk, at a later chunk's growth and once the batch is final.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvtool.engine.admission import OutputReservation
from kvtool.engine.batch import Batch, TokenBudget
from kvtool.engine.drafts import DraftModel
from kvtool.engine.request_state import Phase, RequestState
from kvtool.engine.runtimes.admission import ConnectorAdmission
from kvtool.manager.manager import KvCacheManager

__all__ = ["Batch", "Scheduler", "SchedulerConfig"]


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


class Scheduler:
    def __init__(self, manager: KvCacheManager, config: SchedulerConfig, admission: ConnectorAdmission,
                 pause: Callable[[RequestState], None] | None = None, drafts: DraftModel | None = None) -> None:
        self.manager = manager
        self.config = config
        self.admission = admission
        self._pause = pause
        self._drafts = drafts
        self.iteration = 0
        self._reservation = OutputReservation(manager) if config.reserve_outputs else None

    def schedule(self, running: list[RequestState], waiting: Iterable[RequestState], iteration: int,
                 loading: Sequence[RequestState] = ()) -> Batch:
        """One iteration's batch. `loading`: requests holding pages outside the batch (an
        asynchronous load in flight), which output reservation counts as still growing."""
        self.iteration = iteration
        batch = Batch()
        if self._reservation is not None:
            self._reservation.start_pass([*running, *loading])
        alone = not running and not loading
        budget = TokenBudget(self.config.max_num_tokens)
        running = list(running)
        for state in running:
            if state.phase is Phase.GENERATION and self._room(batch, budget):
                drafts = self._num_drafts(state, budget.left)
                if self._grow(state, state.request.get_num_tokens() + drafts, running, batch):
                    state.num_drafts = drafts
                    batch.generation.append(state)
                    budget.take(1 + drafts)
        for state in running:
            if state.phase is Phase.CONTEXT:
                n = self.admission.chunk(state.position, state.prompt_len, budget)
                capacity = self.admission.context_capacity(state, state.position + n)
                if n and self._room(batch, budget) and self._grow(state, capacity, running, batch):
                    batch.context.append((state, n))
                    budget.take(n)
        for state in waiting:
            if state.request.is_generation_only_request:
                if self._room(batch, budget) and self._admit_generation_only(state):
                    batch.received.append(state)
                    batch.context.append((state, 1))
                    budget.take(1)
                continue
            if not self._room(batch, budget):
                break
            first_alone = alone and not batch.num_requests
            # first_chunk calls it before this loop goes on: the closure reads this iteration's first_alone
            n = self.admission.first_chunk(state, budget, lambda s: self._admits(s, first_alone))  # noqa: B023
            if n:
                batch.context.append((state, n))
                batch.first_chunks.append(state)
                budget.take(n)
            elif self._reservation is not None and state.phase is Phase.WAITING:
                break   # first come, first served: later arrivals do not overtake a deferred one
        self.admission.final_batch(batch, iteration)
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
        while not state.held_kv.resize(capacity):
            victim = self._victim(state, running, batch) if self.config.pause_to_grow else None
            if victim is None:
                return False
            assert self._pause is not None   # an engine that pauses to grow passes `pause`
            self._pause(victim)
        return True

    @staticmethod
    def _victim(state: RequestState, running: list[RequestState], batch: Batch) -> RequestState | None:
        """The running request started last that this batch does not hold yet (never `state`)."""
        scheduled = {s.request_id for s, _ in batch.context} | {s.request_id for s in batch.generation}
        candidates = [s for s in running if s is not state and s.request_id not in scheduled
                      and s.phase in (Phase.CONTEXT, Phase.GENERATION)]
        return max(candidates, key=lambda s: s.arrival_order, default=None)

    def _admits(self, state: RequestState, alone: bool) -> bool:
        """Output reservation's word on a request whose first chunk holds its pages. `alone`:
        nothing else runs, so it cannot refuse."""
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

    def _room(self, batch: Batch, budget: TokenBudget) -> bool:
        return batch.num_requests < self.config.max_batch_size and budget.left >= 1
