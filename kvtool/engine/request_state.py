"""What the runtime knows about one request while it runs."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtool.connector.request import Request, RequestProgress, progress_of
from kvtool.errors import LogicError
from kvtool.manager.kv_cache import KvCache


class Phase(enum.Enum):
    WAITING = "waiting"            # not admitted yet, or deferred
    CONTEXT = "context"            # prefill chunks running
    TRANSMISSION = "transmission"  # asynchronous load in flight: kept out of the batch
    GENERATION = "generation"
    SAVING = "saving"              # finished; asynchronous save in flight, pages held
    DONE = "done"
    FAILED = "failed"


class FailureReason(enum.Enum):
    """Why a request FAILED; `RequestState.error` carries the human-readable detail."""

    ABORTED = "aborted"
    ASK_RAISED = "get_num_new_matched_tokens raised"
    ASK_REFUSED = "the runtime refused the connector's answer"
    ALLOC_HOOK_RAISED = "update_state_after_alloc raised"
    FINISHED_HOOK_RAISED = "request_finished raised"
    CONNECTOR_FAILED_IN_PASS = "connector failed during the pass"
    STUCK_IN_TRANSMISSION = "stuck in transmission"


@dataclass
class Offer:
    """The connector's memoised answer, as absolute prompt positions [start, end)."""

    start: int
    end: int
    is_async: bool
    closed: bool = False
    """Delivered or cancelled: nothing of it is left to hand out."""


_NEXT: dict[Phase, frozenset[Phase]] = {
    Phase.WAITING: frozenset({Phase.CONTEXT, Phase.FAILED}),
    Phase.CONTEXT: frozenset({Phase.TRANSMISSION, Phase.GENERATION, Phase.SAVING, Phase.DONE, Phase.FAILED,
                              Phase.WAITING}),
    Phase.TRANSMISSION: frozenset({Phase.CONTEXT, Phase.FAILED}),
    Phase.GENERATION: frozenset({Phase.SAVING, Phase.DONE, Phase.FAILED, Phase.WAITING}),
    Phase.SAVING: frozenset({Phase.DONE, Phase.FAILED}),
    Phase.DONE: frozenset(),
    Phase.FAILED: frozenset(),
}
"""The phases a request may move to from each phase: the one written rule of its life cycle."""


@dataclass
class RequestState:
    """A request's runtime state. Invariant: `phase` changes only through the transition methods
    below, along `_NEXT` (anything else is a LogicError: a runtime bug, never the connector's)."""

    request: Request
    _phase: Phase = Phase.WAITING
    kv: KvCache | None = None
    asked: bool = False
    offer: Offer | None = None
    position: int = 0
    """Tokens whose KV is in the cache (or lands in it before this pass's layers read it)."""
    num_external: int = 0
    num_local_hit: int = 0
    delivered_at: int = -1
    seen_by_connector: bool = False
    reported_tokens: int = -1
    """Tokens reported in SchedulerOutput so far; -1 before the first report."""
    reported_blocks: tuple[int, ...] = ()
    """Entries per layer group reported so far (`GroupPages.lengths`)."""
    transmission_since: int = -1
    transmission_started_at: float = 0.0
    """time.monotonic() when the asynchronous load began."""
    error: str | None = None
    """What went wrong, for people (set with `failure`)."""
    failure: FailureReason | None = None
    num_deferrals: int = 0
    arrival_order: int = 0
    """Its place among the engine's requests, in the order they were added."""
    num_drafts: int = 0
    """Draft tokens of its current decode step (set when the step is scheduled)."""
    accepted_drafts: list[int] = field(default_factory=list)
    """The drafts of its current step that will be accepted (drawn before the pass)."""
    num_pauses: int = 0
    paused_at: int = -1
    """The iteration of its last pause (it is not admitted again in that iteration)."""
    block_hashes: list[int] = field(default_factory=list)
    """TensorRT-LLM V1's hash chain of the request's full blocks so far (`RequestData.block_hashes`)."""
    pending_failure: tuple[FailureReason, str] | None = None
    """A cancellation that waits for the request's asynchronous prefix load to retire (its
    allocation is kept until then: the runtime never aborts a transfer)."""
    allocation_reported: bool = False
    """The connector was asked about and told of this allocation (`main`'s V2 asks once per allocation)."""
    recompute_until: int = 0
    """Tokens it had computed when it was last paused: the replay computes them again, less what
    the radix tree or the connector serves."""
    progress: RequestProgress = field(init=False, repr=False)
    """The request's tokens and context phase, which the engine alone changes (the connector reads
    them through `request`)."""

    def __post_init__(self) -> None:
        self.progress = progress_of(self.request)

    @property
    def held_kv(self) -> KvCache:
        """`kv` where the request holds pages (admitted, not yet released); LogicError elsewhere."""
        if self.kv is None:
            raise LogicError(f"request {self.request_id} holds no KV cache")
        return self.kv

    @property
    def request_id(self) -> int:
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        return self.request.prompt_len

    @property
    def prompt_tokens(self) -> Sequence[int]:
        """The context phase's tokens, without a copy (read only): the prompt, or after a pause every token so far."""
        return self.progress.prompt_view()

    @property
    def tokens(self) -> Sequence[int]:
        """Prompt then generated tokens, without a copy (read only; it grows as tokens are generated)."""
        return self.progress.token_view()

    @property
    def is_live(self) -> bool:
        return self._phase not in (Phase.DONE, Phase.FAILED)

    @property
    def phase(self) -> Phase:
        return self._phase

    # ---- transitions -------------------------------------------------------------------------
    def _move(self, phase: Phase) -> None:
        if phase not in _NEXT[self._phase]:
            raise LogicError(f"request {self.request_id}: {self._phase.value} -> {phase.value} is not a transition")
        self._phase = phase

    def admit(self, kv: KvCache, position: int, num_local_hit: int) -> None:
        """WAITING -> CONTEXT: pages granted; `position` tokens are in the cache (or land before
        the first pass reads them)."""
        self._move(Phase.CONTEXT)
        self.kv, self.position, self.num_local_hit = kv, position, num_local_hit
        self.progress.set_context_position(position)

    def serve_from(self, position: int) -> None:
        """A served prefix moved the start of the request's first chunk to `position` (CONTEXT:
        `main`'s V2 learns what the connector serves once the chunk is already allocated)."""
        if self._phase is not Phase.CONTEXT or position < self.position:
            raise LogicError(f"request {self.request_id}: cannot serve from {position} at {self.position} "
                             f"({self._phase.value})")
        self.position = position
        self.progress.set_context_position(position)

    def start_transmission(self, iteration: int) -> None:
        """CONTEXT -> TRANSMISSION: an asynchronous load began; out of the batch until it lands."""
        self._move(Phase.TRANSMISSION)
        self.transmission_since = iteration
        self.transmission_started_at = time.monotonic()

    def load_landed(self) -> None:
        """TRANSMISSION -> CONTEXT: every rank reported the load."""
        self._move(Phase.CONTEXT)

    def start_generation(self) -> None:
        """CONTEXT -> GENERATION: the prompt is computed and the first token sampled."""
        if self._phase is not Phase.GENERATION:
            self._move(Phase.GENERATION)

    def start_saving(self) -> None:
        """-> SAVING: finished, its asynchronous save in flight (the engine's `lifecycle.SaveHolds`
        keeps its pages)."""
        self._move(Phase.SAVING)

    def pause(self, num_computed: int) -> None:
        """CONTEXT/GENERATION -> WAITING: its allocation was taken back (the caller closed its
        cache, which held `num_computed` tokens) and it runs again from the start, its tokens so
        far as the context. Everything the connector was told about this allocation is void: it
        is asked again and reported new."""
        self._move(Phase.WAITING)
        self.recompute_until = max(self.recompute_until, num_computed)
        self.num_pauses += 1
        self.kv, self.offer, self.asked, self.position = None, None, False, 0
        self.num_external = self.num_local_hit = 0
        self.delivered_at, self.seen_by_connector = -1, False
        self.allocation_reported, self.block_hashes = False, []
        self.forget_reported()
        self.progress.pause()
        self.request.py_num_connector_matched_tokens = 0

    def forget_reported(self) -> None:
        """Its allocation is gone and it runs again: its next report to the connector is new and
        whole (TensorRT-LLM's `reset_request`)."""
        self.reported_tokens, self.reported_blocks = -1, ()

    def end(self, phase: Phase, failure: FailureReason | None = None, error: str | None = None) -> None:
        """-> DONE or FAILED (with its reason)."""
        self._move(phase)
        if failure is not None:
            self.failure = failure
        self.error = error
