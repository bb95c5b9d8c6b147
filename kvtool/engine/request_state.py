"""What the runtime knows about one request while it runs."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvtool.connector.request import Request
from kvtool.manager.kv_cache import KvCache
from kvtool.manager.manager import PageHold


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


@dataclass
class RequestState:
    request: Request
    phase: Phase = Phase.WAITING
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
    hold: PageHold | None = None
    error: str | None = None
    """What went wrong, for people (set with `failure`)."""
    failure: FailureReason | None = None
    num_deferrals: int = 0
    arrival_order: int = 0
    """Its place among the engine's requests, in the order they were added."""

    @property
    def request_id(self) -> int:
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        return self.request.prompt_len

    @property
    def is_live(self) -> bool:
        return self.phase not in (Phase.DONE, Phase.FAILED)
