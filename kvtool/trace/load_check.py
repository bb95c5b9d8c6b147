"""Whether a replay's engine kept up with its arrivals: when requests arrive faster than it serves
them, the queue grows for the whole trace and TTFT measures the queue, not the cache tier."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvtool.trace.recorder import RequestRow

OVERLOAD_SERVED_FRACTION = 0.95
"""Served below this fraction of the arrival rate, with queueing most of the median TTFT: overloaded."""


@dataclass(frozen=True)
class LoadCheck:
    arrival_rate: float
    """Requests a second over the span of arrivals."""
    served_rate: float
    """Requests a second from the first arrival to the last request's end."""
    prompt_tokens_per_s: float
    """Prompt tokens a second over the span of arrivals."""
    queue_p50_s: float
    """Median wait between arrival and the first pass (or load)."""
    ttft_p50_s: float

    @property
    def overloaded(self) -> bool:
        return (self.served_rate < OVERLOAD_SERVED_FRACTION * self.arrival_rate
                and self.queue_p50_s > 0.5 * self.ttft_p50_s)

    def note(self) -> str | None:
        """The warning to print, or None when the engine kept up."""
        if not self.overloaded:
            return None
        return (f"the engine is overloaded: requests arrive at {self.arrival_rate:.3g}/s "
                f"({self.prompt_tokens_per_s:,.0f} prompt tokens/s) and it served {self.served_rate:.3g}/s; the "
                f"median request queued {self.queue_p50_s:.3g} s of its {self.ttft_p50_s:.3g} s TTFT, so TTFT measures "
                "the queue more than the tier: add engines (--instances), GPUs (--tp), or replay fewer requests")

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "overloaded": self.overloaded}


def load_check(rows: Sequence[RequestRow]) -> LoadCheck | None:
    """The check over a replay's finished requests; None with fewer than two timed ones, or when
    all arrived at once."""
    done = [(r, r.first_scheduled, r.first_token, r.finished) for r in rows]
    timed = [(r, scheduled, first, end) for r, scheduled, first, end in done
             if scheduled is not None and first is not None and end is not None]
    if len(timed) < 2:
        return None
    start = min(r.arrival for r, *_ in timed)
    span = max(r.arrival for r, *_ in timed) - start
    makespan = max(end for *_, end in timed) - start
    if span <= 0 or makespan <= 0:
        return None                  # every request at once: a batch, not an arrival rate
    return LoadCheck(arrival_rate=len(timed) / span, served_rate=len(timed) / makespan,
                     prompt_tokens_per_s=sum(r.prompt_len for r, *_ in timed) / span,
                     queue_p50_s=float(np.median([scheduled - r.arrival for r, scheduled, _, _ in timed])),
                     ttft_p50_s=float(np.median([first - r.arrival for r, _, first, _ in timed])))
