"""Which rank a connector's code runs as: what `tensorrt_llm.mpi_rank()` answers under `--compat trtllm`.

A follower rank is a process of its own; with several ranks in one process (`ranks_as_processes`
off) the runtime says which rank each hook call belongs to.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_rank = 0
_world_size = 1


def current_rank() -> int:
    return _rank


def world_size() -> int:
    return _world_size


def set_process_rank(rank: int, num_ranks: int) -> None:
    """The rank this whole process runs as (a follower, or rank 0 of a group)."""
    global _rank, _world_size
    _rank, _world_size = rank, num_ranks


@contextlib.contextmanager
def acting_as(rank: int) -> Iterator[None]:
    """Run the body as `rank` (then restore the rank before)."""
    global _rank
    before, _rank = _rank, rank
    try:
        yield
    finally:
        _rank = before
