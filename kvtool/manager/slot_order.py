"""Which free slot an allocation takes: the order in which a pool group's freed slots come back.

The manager's default is FIFO (a freed slot goes to the back of the free list). kvtool validate
also hands out the most recently freed slot first (LIFO: the next request gets exactly the pages
the last one released, so a connector still writing into released pages hits a live request) or
a seeded random free slot, to vary the schedule under `--explore`.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Protocol

from kvtool.errors import InputError
from kvtool.types import PageIndex


class SlotOrder(Protocol):
    """Takes the next slot out of a non-empty free list (freed slots are appended on the right);
    slots never used are handed out lowest first (the highest stay free: a write through
    BAD_PAGE_INDEX, slot -1, hits a canary there rather than a request)."""

    name: str

    def initial(self, num_slots: int) -> deque[PageIndex]:
        """The free list before any allocation."""
        ...

    def take(self, free: deque[PageIndex]) -> PageIndex: ...


class Fifo:
    name = "fifo"

    def initial(self, num_slots: int) -> deque[PageIndex]:
        return deque(PageIndex(i) for i in range(num_slots))

    def take(self, free: deque[PageIndex]) -> PageIndex:
        return free.popleft()


class Lifo:
    name = "lifo"

    def initial(self, num_slots: int) -> deque[PageIndex]:
        return deque(PageIndex(i) for i in reversed(range(num_slots)))

    def take(self, free: deque[PageIndex]) -> PageIndex:
        return free.pop()


class SeededRandom(Fifo):
    """A free slot drawn from a generator seeded once: the same seed, the same slots (never-used
    slots too: the lowest first holds only for the other orders)."""

    name = "random"

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def take(self, free: deque[PageIndex]) -> PageIndex:
        at = self._rng.randrange(len(free))
        free.rotate(-at)
        slot = free.popleft()
        free.rotate(at)
        return slot


SLOT_ORDERS = ("fifo", "lifo", "random")


def slot_order(name: str, seed: int = 0) -> SlotOrder:
    """The order called `name` (one of SLOT_ORDERS); `seed` seeds the random one."""
    if name == "fifo":
        return Fifo()
    if name == "lifo":
        return Lifo()
    if name == "random":
        return SeededRandom(seed)
    raise InputError(f"unknown slot order {name!r}; one of {', '.join(SLOT_ORDERS)}")
