"""The GPU pool a replay gets from its model: what one GPU keeps for KV once it holds its share of
the weights and a reserve for activations.

    pool = GPU memory - weights / tp - ACTIVATION_RESERVE x GPU memory

The reserve (10 %) is what vLLM leaves by default (`gpu_memory_utilization` 0.9) and TensorRT-LLM's
`free_gpu_memory_fraction` 0.9 leaves of the memory free after the weights: activations, CUDA
graphs, the allocator's slack. The pool is per GPU, each tensor-parallel rank holding its shard of
every block; `--gpu-memory` (or `--num-slots`) gives the pool itself instead.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvtool.errors import InputError
from kvtool.trace.gpus import GpuSpec
from kvtool.units import format_gib

ACTIVATION_RESERVE = 0.10


@dataclass(frozen=True)
class GpuPool:
    gpu: str
    gpu_memory_bytes: int
    weight_bytes_per_rank: int
    reserve_bytes: int
    tp: int

    @property
    def pool_bytes(self) -> int:
        return self.gpu_memory_bytes - self.weight_bytes_per_rank - self.reserve_bytes

    def describe(self, model: str) -> str:
        """One line: the pool and how it was reached."""
        return (f"GPU pool {format_gib(self.pool_bytes)} a GPU: {self.gpu}'s {format_gib(self.gpu_memory_bytes)} less "
                f"{model}'s weights ({format_gib(self.weight_bytes_per_rank)} a GPU at --tp {self.tp}) and "
                f"{ACTIVATION_RESERVE:.0%} for activations ({format_gib(self.reserve_bytes)}); --gpu-memory sets it")

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "pool_bytes": self.pool_bytes, "activation_reserve": ACTIVATION_RESERVE}


def gpu_pool(gpu: GpuSpec, weight_bytes: float, tp: int, model: str) -> GpuPool:
    """The pool of one GPU of `gpu` serving a 1/tp shard of `weight_bytes`; InputError, with the
    ways out, when nothing is left."""
    per_rank = int(weight_bytes / tp)
    reserve = int(gpu.memory_bytes * ACTIVATION_RESERVE)
    pool = GpuPool(gpu.name, gpu.memory_bytes, per_rank, reserve, tp)
    if pool.pool_bytes <= 0:
        raise InputError(f"{model}'s weights ({format_gib(weight_bytes)}, {format_gib(per_rank)} a GPU at --tp {tp}) "
                         f"leave no KV pool on an {gpu.name} ({format_gib(gpu.memory_bytes)}, "
                         f"{ACTIVATION_RESERVE:.0%} kept for activations): give a larger --tp, another --gpu, "
                         "or the pool itself with --gpu-memory")
    return pool
