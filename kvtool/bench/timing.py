"""Timing: CUDA events on the current stream after a warm-up (GPU), perf_counter (CPU)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Timing:
    seconds: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def percentile_us(self, q: float) -> float:
        return float(np.percentile(np.array(self.seconds) * 1e6, q))


def time_repeats(run: Callable[[], object], repeats: int, cuda: bool) -> Timing:
    """Seconds of each of `repeats` runs of `run` (the caller warms up first)."""
    if not cuda:
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            seconds.append(time.perf_counter() - start)
        return Timing(seconds)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    torch.cuda.synchronize()
    for begin, end in events:
        begin.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return Timing([start.elapsed_time(end) / 1e3 for start, end in events])
