"""How long a connector's background work is held back (`held_work`): a point of the iteration
per task, drawn from a seed.

The release points of an iteration, in order: each connector hook's return, the return of
`get_finished`, and the gate (once `get_finished`'s reports were acted on: the pages of reported
saves released). A task is due at the first point at or past its `HoldPoint` counted from the
iteration whose hook started it; it runs earlier when something waits for it (the connector's
own wait, an iteration in which nothing else can run, the end of the run).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import IntEnum


class HoldPoint(IntEnum):
    """Where a held task is released, earliest first."""

    AFTER_HOOK = 0
    """As soon as the hook that started it has returned."""
    GET_FINISHED = 1
    """Once its iteration's `get_finished` returned: the runtime polled before it could land."""
    GATE = 2
    """Its iteration's gate: after the saves `get_finished` reported were acted on (pages released)."""
    NEXT_GATE = 3
    """The next iteration's gate: after that iteration's metadata was bound and its hooks ran
    (the latest point: the contract lets a load or save still pending then be pending longer, but
    the runtime's own waits come first)."""


@dataclass(frozen=True)
class HoldPolicy:
    """`latest`: every task held until NEXT_GATE (the default seed); else each task's point drawn
    from `random.Random(seed)`, one draw per task in the order the connector started them."""

    seed: int = 0
    latest: bool = True

    def points(self) -> PointDraws:
        """The draws for one run (a fresh sequence: one engine, one schedule)."""
        return PointDraws(None if self.latest else random.Random(self.seed))

    def describe(self) -> str:
        return "held to the latest point" if self.latest else "held to a point drawn per task"


class PointDraws:
    """A run's sequence of `HoldPoint`s (NEXT_GATE each, without a generator)."""

    def __init__(self, rng: random.Random | None) -> None:
        self._rng = rng

    def next(self) -> HoldPoint:
        return HoldPoint.NEXT_GATE if self._rng is None else HoldPoint(self._rng.randrange(len(HoldPoint)))


def is_due(point: HoldPoint, started: int, iteration: int, at: HoldPoint) -> bool:
    """Whether a task of `point`, started in iteration `started`, is due at release point `at`
    of `iteration` (AFTER_HOOK: a hook's return; GET_FINISHED; GATE)."""
    if point is HoldPoint.NEXT_GATE:
        return at is HoldPoint.GATE and iteration > started
    if iteration > started:
        return True
    return at >= point
