"""A vLLM connector that asks vLLM's process groups when it starts, as LMCache's does
(`get_tp_group()` in its worker's constructor): kvtool must initialize them, as vLLM's worker does."""

from __future__ import annotations

from typing import Any

from kvtool.vllm_compat.host_connector import KvtoolHostConnector


class AsksTensorParallelGroup(KvtoolHostConnector):
    """kvtool-host that records the tensor-parallel rank and size vLLM reports at construction."""

    seen: list[tuple[int, int]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size, get_tp_group

        AsksTensorParallelGroup.seen.append((get_tp_group().rank_in_group, get_tensor_model_parallel_world_size()))
        super().__init__(*args, **kwargs)
