"""Typed events of the engine loop, delivered to optional subscribers.

The trace report, validate's judges and any timeline read this one stream instead of each poking
at the engine's state. Every event carries the iteration it happened in and the simulated clock;
token ranges are absolute prompt positions [start, end). With no subscriber, emitting costs one
check.

Order within one request: Ask, then (when the connector offered tokens and pages were found)
Reserve, then Deliver or Cancel of the offer's tokens, LoadStarted/LoadFinished around a load,
then Finished; SaveStarted/SaveFinished bracket an asynchronous save after Finished.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvtool.engine.request_state import FailureReason


@dataclass(frozen=True)
class EngineEvent:
    iteration: int
    clock: float
    """Simulated seconds since the start of the replay."""


@dataclass(frozen=True)
class Arrived(EngineEvent):
    """The request was added to the engine (it waits from `arrival` until a pass takes it)."""

    request_id: int
    prompt_len: int
    arrival: float


@dataclass(frozen=True)
class Paused(EngineEvent):
    """The request's allocation was taken back (MAX_UTILIZATION): it runs again from the start,
    its `num_computed_tokens` to be recomputed less what is reused or loaded."""

    request_id: int
    num_computed_tokens: int
    context_len: int
    """What its replay's context phase computes (prompt and tokens generated before the pause)."""


@dataclass(frozen=True)
class Ask(EngineEvent):
    """`get_num_new_matched_tokens` answered (once per request): the offer, clamped to the prompt."""

    request_id: int
    num_computed_tokens: int
    num_offered_tokens: int
    is_async: bool


@dataclass(frozen=True)
class Reserve(EngineEvent):
    """Pages for the offered tokens: `ok` False when they could not be found (the offer is cancelled)."""

    request_id: int
    start: int
    end: int
    ok: bool


@dataclass(frozen=True)
class Deliver(EngineEvent):
    """The offer became the request's: `num_external` tokens come from the connector."""

    request_id: int
    num_external: int
    num_local_hit: int


@dataclass(frozen=True)
class Cancel(EngineEvent):
    """Tokens [start, end) of an offer handed back through `cancel_load` (never an empty range)."""

    request_id: int
    start: int
    end: int


@dataclass(frozen=True)
class NotHonoured(EngineEvent):
    """Offered tokens [start, end) the runtime did not take and, having no `cancel_load`, does not
    hand back: the connector lets them go when it hears `request_finished` (TensorRT-LLM's V1
    never leaves any; `main`'s V2 when the allocation could not grow to cover them)."""

    request_id: int
    start: int
    end: int


@dataclass(frozen=True)
class Reserved(EngineEvent):
    """`reserve_prefix` promised tokens [start, end) under `reservation_id` (prefix reservations)."""

    request_id: int
    reservation_id: int
    start: int
    end: int
    is_async: bool


@dataclass(frozen=True)
class ReservationReleased(EngineEvent):
    """`release_prefix_reservation` released [start, end) of a reservation (unused, or loaded everywhere)."""

    request_id: int
    reservation_id: int
    start: int
    end: int


@dataclass(frozen=True)
class PrefixLoadRetired(EngineEvent):
    """Every worker reported a confirmed prefix load (`get_finished_prefix_loads`)."""

    request_id: int
    reservation_id: int


@dataclass(frozen=True)
class LoadStarted(EngineEvent):
    """A delivered load begins: in this iteration's pass (sync), or in the background (async)."""

    request_id: int
    num_tokens: int
    is_async: bool


@dataclass(frozen=True)
class LoadFinished(EngineEvent):
    """The loaded KV is in the cache: the end of the pass (sync) or every rank's report (async)."""

    request_id: int


@dataclass(frozen=True)
class SaveStarted(EngineEvent):
    """`request_finished` returned True: an asynchronous save holds the request's pages."""

    request_id: int


@dataclass(frozen=True)
class SaveFinished(EngineEvent):
    """Every rank reported the asynchronous save: its pages are released."""

    request_id: int


@dataclass(frozen=True)
class WorkRan(EngineEvent):
    """Background work the connector started (a pool task, a thread), held by kvtool, ran at this
    iteration (`engine.held_work`)."""

    started_by: str
    """The hook whose call started it ("a connector thread": one of the connector's own)."""
    started_at: int
    """The iteration it was started in."""
    reason: str
    """What released it: its point of the schedule ("AFTER_HOOK", "GET_FINISHED", "GATE",
    "NEXT_GATE"), "waited" (the connector waited for it), "idle", "end"."""


@dataclass(frozen=True)
class Finished(EngineEvent):
    """The request is over: `failure` None when it completed, the reason when it failed."""

    request_id: int
    failure: FailureReason | None
    num_generated_tokens: int
    prompt_len: int = 0
    num_local_hit: int = 0
    """Prompt tokens the local radix tree served."""
    num_external: int = 0
    """Prompt tokens the connector delivered."""
    arrival: float = 0.0


@dataclass(frozen=True)
class Evicted(EngineEvent):
    """The radix tree lost a cached block's page in one layer group to make room."""

    layer_group_id: int
    block_ordinal: int


@dataclass(frozen=True)
class PassDone(EngineEvent):
    """An iteration ended: what each request in its pass computed ([start, end) of its tokens),
    the simulated seconds it took (`clock` is its start), the slots in use after it, and the prompt
    tokens served from a cache (local or connector) to the requests that started in it."""

    items: tuple[tuple[int, int, int], ...]
    seconds: float
    pages_in_use: int
    hit_tokens: int = 0


Subscriber = Callable[[EngineEvent], None]


class EventStream:
    """Fan-out of engine events to subscribers, in subscription order."""

    def __init__(self) -> None:
        self._subscribers: list[Subscriber] = []
        self._wanted: set[type] | None = set()
        """Event kinds some subscriber reads; None: every kind."""

    def subscribe(self, subscriber: Subscriber) -> None:
        """Add `subscriber`. One with an `event_kinds` attribute (a set of event classes) declares
        that it reads only those, so the engine need not build the others (an eviction event per
        evicted page is most of a large replay's events)."""
        self._subscribers.append(subscriber)
        kinds = getattr(subscriber, "event_kinds", None)
        self._wanted = None if kinds is None or self._wanted is None else self._wanted | set(kinds)

    @property
    def active(self) -> bool:
        return bool(self._subscribers)

    def wants(self, kind: type) -> bool:
        """Whether some subscriber reads events of `kind`."""
        return self._wanted is None or kind in self._wanted

    def emit(self, event: EngineEvent) -> None:
        for subscriber in self._subscribers:
            subscriber(event)


class EventLog:
    """A subscriber that keeps every event, for judges and reports that read them afterwards."""

    def __init__(self) -> None:
        self.events: list[EngineEvent] = []

    def __call__(self, event: EngineEvent) -> None:
        self.events.append(event)

    def of(self, kind: type[EngineEvent]) -> list:
        return [e for e in self.events if isinstance(e, kind)]
