"""What a validate run varies, drawn from its seed: one seed, one schedule, one verdict.

Seed 0 (the default) is the canonical schedule: the slot a request gets is the one released last
(LIFO: the next request gets exactly the pages the last one released), the batch and chunk sizes
each scenario chose, idle polls of `get_finished` every 0.5 ms, every piece of background work the
connector starts held to the latest point the contract allows (`engine.hold_policy`), and
`pause-replay`'s pool as sized. Every other seed draws each of these from `random.Random(seed)`
(background work: a point between the earliest and the latest per task): `--explore N` runs several.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

from kvtool.engine.hold_policy import HoldPolicy
from kvtool.manager.slot_order import SLOT_ORDERS

DEFAULT_SEED = 0


@dataclass(frozen=True)
class SeedSchedule:
    seed: int
    slot_order: str = "lifo"
    """Which free slot an allocation takes (`slot_order`): lifo, fifo or random."""
    max_batch_size: int | None = None
    """A cap on the batch of runs whose scenario leaves its shape free (None: the scenario's)."""
    chunk_size: int | None = None
    """Chunked prefill for runs whose scenario leaves its shape free (None: not chunked)."""
    idle_wait_seconds: float = 0.0005
    """How long an idle iteration waits for background work before get_finished is polled again."""
    holds_to_latest: bool = True
    """Background work held to the latest point (else to a point drawn per task from the seed)."""
    pause_room_delta: int = 0
    """Blocks fewer in `pause-replay`'s pool: other preemption points."""

    def describe(self) -> str:
        """One line: what this seed's schedule is."""
        shape = f"batch <= {self.max_batch_size or 'scenario'}, chunks {self.chunk_size or 'none'}"
        return (f"seed {self.seed}: slots {self.slot_order}, {shape}, idle poll {self.idle_wait_seconds * 1e3:g} ms, "
                f"background work {self.hold_policy.describe()}, pause room -{self.pause_room_delta}")

    @property
    def hold_policy(self) -> HoldPolicy:
        return HoldPolicy(self.seed, self.holds_to_latest)


@functools.lru_cache(maxsize=256)
def schedule_for(seed: int) -> SeedSchedule:
    """The schedule of `seed` (DEFAULT_SEED: the canonical one)."""
    if seed == DEFAULT_SEED:
        return SeedSchedule(seed)
    rng = random.Random(seed)
    # Two draws of an earlier schedule (a wall-clock settle, replaced by held work) stay drawn, so
    # that every seed keeps the rest of the schedule it had.
    settled = rng.choice((0, 1, 3))
    slot_order: str = rng.choice(SLOT_ORDERS)   # drawn in this order, as they always were
    max_batch_size: int | None = rng.choice((None, 2, 3, 5))
    chunk_size: int | None = rng.choice((None, 3, 5, 9))
    idle_wait_seconds: float = rng.choice((0.0001, 0.0005, 0.002))
    if settled:
        rng.choice((0.0001, 0.001))
    return SeedSchedule(seed, slot_order, max_batch_size, chunk_size, idle_wait_seconds, holds_to_latest=False,
                        pause_room_delta=rng.choice((0, 0, 1)))

