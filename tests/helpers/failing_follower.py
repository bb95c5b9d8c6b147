"""A follower rank whose process group cannot form after it reached the rendezvous (as an NCCL
communicator that fails on a broken GPU would): the real `follow`, with `init_process_group`
refusing in this process only. Importable by a spawned child."""

from __future__ import annotations

from kvtool.engine import ranks

REFUSAL = "NCCL error: unhandled system error"


def follow_whose_group_fails(rank: int, pickled_setup: bytes, hook_name) -> None:
    import torch.distributed as dist

    def refuse(*args, **kwargs):
        raise RuntimeError(REFUSAL)
    dist.init_process_group = refuse
    ranks.follow(rank, pickled_setup, hook_name)
