"""Prefix reservations (`main`'s V2, prefix-aware scheduling): the runtime's book of promises.

A reservation is what `reserve_prefix` promised for one attempt to admit a request: tokens
[start, end) the connector keeps loadable under a fresh id. Its life, as TensorRT-LLM's connector
docs' "Reserving a prefix during admission" tells it (read at NVIDIA/TensorRT-LLM@785b0128
`connectors/prefix_load_completion.py` and the reservation manager of brb-nv/TensorRT-LLM@64ecf956):

1. candidate queried: the connector protects the source, nothing is sent;
2. candidate rejected (the request left the batch) or offer shortened (clamped, floored to a
   block): the unused part is released; a later attempt gets a new id;
3. accepted: a `PrefixLoad` in the iteration's `SchedulerOutput.prefix_loads`; the destination
   pages are the request's and stay allocated until the load is done;
4. a request cancelled during an asynchronous load keeps its allocation until the load is done;
5. every worker reported the load (`get_finished_prefix_loads`): the accepted range is released,
   and the request resumes (or, cancelled, is finalized).

Invariant (the judges check it from the events): every token of a promise is released exactly once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtool.connector.api import PrefixLoad
from kvtool.connector.request import Request
from kvtool.connector.runtime import ConnectorRuntime
from kvtool.engine.events import PrefixLoadRetired, ReservationReleased, Reserved
from kvtool.errors import LogicError
from kvtool.group_pages import GroupPages


@dataclass
class Reservation:
    reservation_id: int
    request: Request
    start: int
    end: int
    is_async: bool
    unreleased: list[tuple[int, int]] = field(default_factory=list)
    """Parts of [start, end) not released yet, in order."""
    accepted: tuple[int, int] | None = None
    """The confirmed load's range, once the request is in the final batch."""
    accepted_at: tuple[int, float] = (0, 0.0)
    """The iteration and `time.monotonic()` of its confirmation (the wait for its retirement is bounded)."""


class ReservationBook:
    """The reservations of one engine, by id (fresh ids from 1, one per attempt)."""

    def __init__(self, connector: ConnectorRuntime, emit: Callable[..., None]) -> None:
        self._connector = connector
        self._emit = emit
        self._next_id = 1
        self._live: dict[int, Reservation] = {}
        self._loads: list[PrefixLoad] = []
        self.given_up: set[int] = set()
        """Ids of confirmed loads released before every worker reported them: a late report is no violation."""

    def open(self, rid: int, request: Request, start: int, count: int, is_async: bool) -> Reservation:
        """The promise `reserve_prefix` made under `rid` (from `next_id`): [start, start + count)."""
        reservation = Reservation(rid, request, start, start + count, is_async, [(start, start + count)])
        self._live[rid] = reservation
        self._emit(Reserved, request_id=request.request_id, reservation_id=rid, start=start, end=start + count,
                   is_async=is_async)
        return reservation

    def next_id(self) -> int:
        """A fresh reservation id for the attempt about to ask."""
        rid, self._next_id = self._next_id, self._next_id + 1
        return rid

    def release(self, reservation: Reservation, start: int, end: int) -> None:
        """Release [start, end) of `reservation` (nothing for an empty range); LogicError when part
        of it was released already: the runtime's bug, never the connector's."""
        if end <= start:
            return
        part = next(((s, e) for s, e in reservation.unreleased if s <= start and end <= e), None)
        if part is None:
            raise LogicError(f"reservation {reservation.reservation_id}: [{start}, {end}) is not unreleased "
                             f"({reservation.unreleased})")
        at = reservation.unreleased.index(part)
        reservation.unreleased[at:at + 1] = [r for r in ((part[0], start), (end, part[1])) if r[0] < r[1]]
        self._connector.release_reservation(reservation.request, reservation.reservation_id, start, end)
        self._emit(ReservationReleased, request_id=reservation.request.request_id,
                   reservation_id=reservation.reservation_id, start=start, end=end)
        if not reservation.unreleased:
            del self._live[reservation.reservation_id]

    def release_unaccepted(self, reservation: Reservation) -> None:
        """Release every part of a reservation still unreleased (its candidate was rejected, or its
        load given up on)."""
        for start, end in list(reservation.unreleased):
            self.release(reservation, start, end)

    def accept(self, reservation: Reservation, pages: GroupPages, tokens: list[int], cache_salt: str | None,
               iteration: int) -> None:
        """The request is in the final batch (of `iteration`): its reservation's load is confirmed into `pages`."""
        reservation.accepted = (reservation.start, reservation.end)
        reservation.accepted_at = (iteration, time.monotonic())
        self._loads.append(PrefixLoad(reservation.reservation_id, reservation.request.request_id, reservation.start,
                                      reservation.end, reservation.is_async, pages.as_lists(), tokens, cache_salt))

    def take_loads(self) -> list[PrefixLoad]:
        """The loads confirmed since the last call (the coming `SchedulerOutput.prefix_loads`)."""
        loads, self._loads = self._loads, []
        return loads

    def withdraw(self, request_id: int) -> None:
        """The request failed before its confirmed load was dispatched: the load is taken back and
        its reservation released whole (a dispatched load is released when it retires)."""
        undispatched = [load for load in self._loads if load.request_id == request_id]
        self._loads = [load for load in self._loads if load.request_id != request_id]
        for load in undispatched:
            self.release_unaccepted(self._live[load.reservation_id])

    def give_up(self, request_id: int) -> None:
        """Release the request's confirmed loads that have not retired (it failed: no worker will
        report them, or none in time)."""
        for reservation in [r for r in self._live.values() if r.request.request_id == request_id and r.accepted]:
            self.given_up.add(reservation.reservation_id)
            self.release_unaccepted(reservation)

    @property
    def tracked(self) -> set[int]:
        """Ids of accepted loads not retired yet."""
        return {rid for rid, r in self._live.items() if r.accepted is not None}

    def unretired_since(self) -> list[tuple[int, float]]:
        """`accepted_at` of every confirmed load not retired yet."""
        return [r.accepted_at for r in self._live.values() if r.accepted is not None]

    def retire(self, reservation_id: int) -> Reservation:
        """Every worker reported the load: its range is released."""
        reservation = self._live[reservation_id]
        self._emit(PrefixLoadRetired, request_id=reservation.request.request_id, reservation_id=reservation_id)
        start, end = reservation.accepted or (reservation.start, reservation.end)
        self.release(reservation, start, end)
        return reservation

