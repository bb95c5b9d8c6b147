"""The engine's requests: every one by id, the live ones waiting for admission and the live ones
started, each in arrival order."""

from __future__ import annotations

from bisect import insort
from collections.abc import Iterator

from kvtool.connector.request import Request
from kvtool.engine.request_state import Phase, RequestState
from kvtool.errors import InputError


def _arrival_order(state: RequestState) -> int:
    return state.arrival_order


class RequestQueues:
    """Invariant: every live request is in exactly one of `waiting` and `started`, each in arrival
    order, and in `states`; a request over is in neither (and, with `forget_finished`, not in
    `states` either)."""

    def __init__(self, forget_finished: bool) -> None:
        self.states: dict[int, RequestState] = {}
        self.waiting: dict[int, RequestState] = {}
        """Live requests not yet admitted, in arrival order (WAITING is only ever a request's first
        phase, or its phase after a pause). A long replay's queue holds thousands: an iteration
        looks at no more of them than the scheduler takes, so its cost does not grow with the queue."""
        self.started: list[RequestState] = []
        """The other live requests, in arrival order (as many as the pool holds)."""
        self._num_added = 0
        self._forget_finished = forget_finished

    def require_new_id(self, request: Request) -> None:
        """InputError for an id used before."""
        if request.request_id in self.states:
            raise InputError(f"request id {request.request_id} is used twice")

    def add(self, request: Request) -> RequestState:
        """A new request (`require_new_id` passed) joins the waiting queue."""
        state = RequestState(request, arrival_order=self._num_added)
        self._num_added += 1
        self.states[request.request_id] = state
        self.waiting[request.request_id] = state
        return state

    @property
    def live(self) -> list[RequestState]:
        """Every request not over yet, in arrival order."""
        return sorted([*self.started, *self.waiting.values()], key=_arrival_order)

    def is_done(self) -> bool:
        return not self.waiting and not self.started

    def started_in(self, *phases: Phase) -> list[RequestState]:
        """The started requests in one of `phases`, in arrival order."""
        return [s for s in self.started if s.phase in phases]

    def arrived_waiting(self, clock: float, iteration: int,
                        visited: list[tuple[RequestState, int]]) -> Iterator[RequestState]:
        """The waiting requests that have arrived by `clock`, in order, lazily: the scheduler stops
        at the first it cannot take. Each one it is handed goes into `visited` with its deferral
        count. A request paused in `iteration` is not handed out again in it."""
        for state in list(self.waiting.values()):
            if state.phase is Phase.WAITING and state.request.arrival <= clock and state.paused_at != iteration:
                visited.append((state, state.num_deferrals))
                yield state

    def move_started(self, visited: list[tuple[RequestState, int]]) -> None:
        """Requests the scheduler admitted leave the queue for the started list (arrival order)."""
        for state, _ in visited:
            if state.phase is not Phase.WAITING and self.waiting.pop(state.request_id, None) is not None:
                insort(self.started, state, key=_arrival_order)

    def requeue(self, state: RequestState) -> None:
        """A paused request goes back to the waiting queue, in its arrival place."""
        self.started = [s for s in self.started if s is not state]
        self.waiting = dict(sorted([*self.waiting.items(), (state.request_id, state)],
                                   key=lambda entry: entry[1].arrival_order))

    def remove(self, state: RequestState) -> None:
        """A request that is over leaves the queues (and `states`, with `forget_finished`)."""
        if self.waiting.pop(state.request_id, None) is None:
            at = next((i for i, s in enumerate(self.started) if s is state), None)
            if at is not None:
                del self.started[at]
        if self._forget_finished:
            self.states.pop(state.request_id, None)

    def next_arrival_when_idle(self, clock: float) -> float:
        """With nothing started and every waiting request still to arrive: the first arrival
        (an idle engine skips to it); else `clock`."""
        if self.started:
            return clock
        pending = [s.request.arrival for s in self.waiting.values() if s.request.arrival > clock]
        if pending and len(pending) == len(self.waiting):
            return min(pending)
        return clock

    def progress_mark(self) -> tuple:
        """What changes when an iteration makes progress: a started request's phase, or the queue."""
        return [(s.request_id, s.phase) for s in self.started], len(self.waiting)


class Lookahead:
    """An iterator of requests whose next one can be looked at before it is taken."""

    def __init__(self, items: Iterator[Request]) -> None:
        self._items = items
        self._next: Request | None = next(items, None)

    def peek(self) -> Request | None:
        return self._next

    def take(self) -> Request:
        item, self._next = self._next, next(self._items, None)
        return item  # type: ignore[return-value]   # taken only after a peek that was not None
