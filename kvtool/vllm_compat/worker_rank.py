"""The worker whose connector is being built or called (kvtool plays several in one process): what
`get_tensor_model_parallel_rank()` answers in a real engine, for kvtool's own vLLM connector."""

from __future__ import annotations

_current = 0


def set_current_worker(rank: int) -> None:
    global _current
    _current = rank


def current_worker() -> int:
    return _current
