"""The per-engine half of a runtime profile: what happens around a request's allocation.

The scheduler owns the budget, the batch and the order requests are visited in; it calls a
`ConnectorAdmission` at three points, and the admission decides, as its runtime does, when the
connector is asked and what it is told:

1. `first_chunk`: a waiting request's first chunk (create its cache, maybe ask, allocate);
2. `context_capacity`: how far a later chunk's growth allocates;
3. `final_batch`: once the batch is final, before `build_connector_meta` (deliver, or ask).

The steps every runtime shares (the cache created on the local match, the connector's answer
checked and announced, the pages told, an asynchronous load parked) are methods of the base class.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from kvtool.connector.api import PrefixLoad, takes_part_in_reservations
from kvtool.connector.loader import ConnectorSpec
from kvtool.connector.runtime import Answer, ConnectorRuntime, HookResult
from kvtool.engine.batch import Batch, TokenBudget
from kvtool.engine.events import Ask, Cancel, Deliver, LoadStarted
from kvtool.engine.request_state import FailureReason, Offer, RequestState
from kvtool.errors import LogicError
from kvtool.manager.block_keys import ReuseScope
from kvtool.manager.kv_cache import KvCache
from kvtool.manager.manager import KvCacheManager

Admits = Callable[[RequestState], bool]
"""Whether output reservation lets a request whose first chunk holds its pages run (True without it)."""


@dataclass
class AdmissionHost:
    """What an admission works with: the manager, the connector's runtime (None: no connector) and
    the engine's hands (events, failing a request)."""

    manager: KvCacheManager
    connector: ConnectorRuntime | None
    local_reuse: bool
    chunk_size: int | None
    emit: Callable[..., None]
    fail: Callable[[RequestState, FailureReason, str], None]
    """Fail one request cleanly, with the reason and a detail in words (`Lifecycle.fail`)."""
    prefix_reservations: bool = False
    """The connector implements the three reservation hooks (`main`'s V2 then uses them)."""

    @classmethod
    def of(cls, manager: KvCacheManager, connector: ConnectorRuntime | None, spec: ConnectorSpec | None,
           local_reuse: bool, chunk_size: int | None, emit: Callable[..., None],
           fail: Callable[[RequestState, FailureReason, str], None]) -> AdmissionHost:
        """An engine's host (its scheduler config's `local_reuse` and `chunk_size`)."""
        reserving = spec is not None and takes_part_in_reservations(spec.scheduler_class, spec.worker_class)
        return cls(manager, connector, local_reuse, chunk_size, emit, fail, reserving)


class ConnectorAdmission(ABC):
    uses_prefix_loads = False
    """Whether workers are asked `get_finished_prefix_loads` every iteration (prefix reservations)."""

    def __init__(self, host: AdmissionHost) -> None:
        self.host = host
        self.manager = host.manager
        self.connector = host.connector

    # ---- what the scheduler calls --------------------------------------------------------------
    @abstractmethod
    def first_chunk(self, state: RequestState, budget: TokenBudget, admits: Admits) -> int:
        """Admit `state` (WAITING) with its first chunk: the chunk's token count, or 0 when it was
        deferred (its cache closed, `num_deferrals` counted) or failed."""

    def context_capacity(self, state: RequestState, end: int) -> int:
        """The capacity a later chunk ending at `end` resizes the cache to (default: `end`)."""
        return end

    @abstractmethod
    def final_batch(self, batch: Batch, iteration: int) -> None:
        """The batch is final: what the runtime does with its first chunks before the pass."""

    def request_failed(self, state: RequestState) -> None:
        """`state` fails (before `request_finished` is called for it): an offer not delivered yet is
        handed back (`hand_back`)."""
        offer = state.offer
        if offer is not None and not offer.closed:
            offer.closed = True
            self.hand_back(state, offer.start, offer.end)

    def hand_back(self, state: RequestState, start: int, end: int) -> None:
        """Offered tokens [start, end) the request will not use (it failed before delivery).
        Default: nothing is said (runtimes without `cancel_load` release it at `request_finished`)."""

    def take_prefix_loads(self) -> list[PrefixLoad]:
        """The prefix loads confirmed since the last call (`SchedulerOutput.prefix_loads`); none by default."""
        return []

    def retire_reported(self, answers: dict[int, HookResult]) -> tuple[list[int], bool]:
        """Every rank's `get_finished_prefix_loads` answers: (the requests whose prefix load every
        rank has now reported, every call ok). Nothing by default."""
        return [], True

    def unretired_since(self) -> list[tuple[int, float]]:
        """When each confirmed prefix load not yet reported by every rank was confirmed (iteration,
        `time.monotonic()`); none by default."""
        return []

    def holds_allocation(self, state: RequestState) -> bool:
        """Whether `state`'s allocation must outlive a cancellation (an asynchronous prefix load in
        flight, which the runtime never aborts). False by default."""
        return False

    # ---- shared steps --------------------------------------------------------------------------
    @property
    def hooks(self) -> ConnectorRuntime:
        """The connector's runtime; LogicError where the engine has no connector (a kvtool bug:
        callers ask only where `asks` or a connector was checked)."""
        if self.connector is None:
            raise LogicError("a connector step ran on an engine without a connector")
        return self.connector

    @staticmethod
    def cache(state: RequestState) -> KvCache:
        """`state`'s cache; LogicError where it has none (a kvtool bug: admitted requests have one)."""
        if state.kv is None:
            raise LogicError(f"request {state.request_id} has no KV cache here")
        return state.kv

    @staticmethod
    def offer(state: RequestState) -> Offer:
        """`state`'s offer; LogicError where it has none."""
        if state.offer is None:
            raise LogicError(f"request {state.request_id} has no offer here")
        return state.offer

    def create_cache(self, state: RequestState) -> KvCache:
        """`state`'s cache on its local match (SUSPENDED), or an empty one without local reuse."""
        request = state.request
        reused = state.prompt_tokens[:-1] if self.host.local_reuse else []
        kv = self.manager.create_kv_cache(request.request_id, reused, ReuseScope.from_cache_salt(request.cache_salt),
                                          expected_prompt_length=request.prompt_len)
        state.kv = kv
        return kv

    def asks(self, state: RequestState) -> bool:
        """Whether the connector is asked about `state` at all (never for generation-only or dummy requests)."""
        request = state.request
        return self.connector is not None and not request.is_generation_only_request and not request.is_dummy_request

    def query(self, state: RequestState, local_end: int, clamp_to: int) -> Answer | None:
        """The connector's checked answer at `local_end`, announced (`Ask`, the offer clamped to
        `clamp_to`); None when the hook raised (the request has failed)."""
        state.asked = True
        answer = self.hooks.ask(state.request, local_end)
        if answer is None:
            self.host.fail(state, FailureReason.ASK_RAISED, self.hooks.failures[-1].error)
            return None
        if answer.refusal is not None:
            self.refuse(state, answer.refusal)
            return None
        offered = max(min(local_end + answer.num_tokens, clamp_to) - local_end, 0)
        self.host.emit(Ask, request_id=state.request_id, num_computed_tokens=local_end,
                       num_offered_tokens=offered, is_async=answer.is_async)
        return answer

    def refuse(self, state: RequestState, why: str) -> None:
        """The runtime refuses the connector's answer for `state`: the request fails, saying why."""
        self.host.fail(state, FailureReason.ASK_REFUSED, why)

    def chunk(self, position: int, prompt_len: int, budget: TokenBudget) -> int:
        """Tokens of a chunk starting at `position`: what is left of the prompt, within the budget
        and the chunk size."""
        n = min(prompt_len - position, budget.left)
        if self.host.chunk_size:
            n = min(n, self.host.chunk_size)
        return max(n, 0)

    def defer(self, state: RequestState) -> int:
        """Close `state`'s cache and leave it waiting (it is prepared again next iteration): 0."""
        self.cache(state).close()
        state.kv = None
        state.num_deferrals += 1
        return 0

    def cancel(self, state: RequestState, start: int, end: int) -> None:
        """Hand tokens [start, end) back through `cancel_load` (runtimes that have it)."""
        self.hooks.cancel(state.request, start, end)
        if end > start:
            self.host.emit(Cancel, request_id=state.request_id, start=start, end=end)

    def record_delivery(self, state: RequestState, committed: int, end: int, iteration: int) -> None:
        """`end - committed` tokens of the offer come from the connector (0 <= that <= position);
        the offer is closed."""
        offer = self.offer(state)
        recorded = end - committed
        if not 0 <= recorded <= state.position:
            raise LogicError(f"request {state.request_id}: recorded {recorded} external tokens at "
                             f"position {state.position}")
        offer.closed = True
        state.num_external = recorded
        state.request.py_num_connector_matched_tokens = recorded
        state.num_local_hit = committed
        state.delivered_at = iteration
        self.host.emit(Deliver, request_id=state.request_id, num_external=recorded, num_local_hit=committed)
        if recorded:
            self.host.emit(LoadStarted, request_id=state.request_id, num_tokens=recorded, is_async=offer.is_async)

    def tell_pages(self, state: RequestState, batch: Batch) -> bool:
        """`update_state_after_alloc` with the pages that now back `state`; False (the request
        dropped from the batch and failed) when the hook raised."""
        state.seen_by_connector = True
        if self.hooks.after_alloc(state.request, self.cache(state).page_indices_by_group()):
            return True
        batch.drop(state)
        self.host.fail(state, FailureReason.ALLOC_HOOK_RAISED, "")
        return False

    def park(self, state: RequestState, batch: Batch, iteration: int, reported_by_get_finished: bool = True) -> None:
        """`state` loads asynchronously: out of the batch, in TRANSMISSION until every rank reports
        it (through `get_finished`, or a prefix load's retirement)."""
        batch.drop(state)
        batch.loading_started.append(state)
        state.start_transmission(iteration)
        if reported_by_get_finished:
            self.hooks.start_async_load(state.request_id)
