"""The GPUs the cost model knows by name (`--gpu H100|H200|B200`), each rate overridable.

A preset holds what the replay's clock and GPU pool need of one GPU: its memory, the bf16 matmul
rate a prefill reaches, the HBM read rate a decode step reaches, the host-to-GPU rate a connector
load reaches, and NVLink's rate and latency for tensor-parallel all-reduces. Rates are achieved
ones, not datasheet peaks; where this repository measured one it is used, and the other GPUs
scale the datasheet peak by the same measured fraction:

- compute: 750 TFLOP/s measured on the H200 (results/h200-compute: 725-780 alone) of its 989 dense
  bf16 peak (0.76); the H100 has the same chip and clocks; the B200 gets 0.76 of its 2,250.
- HBM: 0.81 of the datasheet bandwidth (3.35 / 4.8 / 8 TB/s), the H200's device copy
  (results/h200-link-study: 1.94 TB/s each way of a 64 MiB copy, 3.88 TB/s of traffic).
- connector loads: 51 GB/s, the H200's SM-kernel host-to-GPU rate (PCIe Gen5 x16; the H100 and
  HGX B200 hosts have the same link).
- memory: what nvidia-smi reports in total (81,559 / 143,771 / 183,359 MiB).
- NVLink: 450 GB/s each way (NVLink 4), 900 (NVLink 5); an all-reduce's latency 8 us.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from kvtool.errors import InputError

MEASURED_COMPUTE_FRACTION = 750.0 / 989.0
MEASURED_HBM_FRACTION = 0.81
MEASURED_LOAD_GBPS = 51.0


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_bytes: int
    """Total memory of one GPU, as the driver reports it."""
    tflops: float
    """bf16 dense matmul rate a prefill reaches (TFLOP/s)."""
    hbm_gbps: float
    """HBM read rate a decode step reaches (GB/s): weights and KV are read at it."""
    load_gbps: float
    """Host-to-GPU rate of a connector load (GB/s)."""
    nvlink_gbps: float
    """NVLink rate of one GPU each way (GB/s), for tensor-parallel all-reduces."""
    allreduce_us: float = 8.0
    """Latency of one all-reduce (microseconds)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _preset(name: str, memory_mib: int, peak_tflops: float, peak_hbm_tbps: float, nvlink_gbps: float) -> GpuSpec:
    return GpuSpec(name, memory_mib * 2**20, round(peak_tflops * MEASURED_COMPUTE_FRACTION, 1),
                   round(peak_hbm_tbps * 1000 * MEASURED_HBM_FRACTION, 1), MEASURED_LOAD_GBPS, nvlink_gbps)


GPUS: dict[str, GpuSpec] = {g.name: g for g in (
    _preset("H100", 81_559, 989.0, 3.35, 450.0),
    _preset("H200", 143_771, 989.0, 4.8, 450.0),
    _preset("B200", 183_359, 2250.0, 8.0, 900.0),
)}
DEFAULT_GPU = "H200"


def gpu_named(name: str | None, tflops: float | None = None, hbm_gbps: float | None = None,
              load_gbps: float | None = None) -> GpuSpec:
    """The preset called `name` (any case; None: the H200), with each rate given replacing its
    own; InputError naming the presets, or a rate that is not positive."""
    key = (name or DEFAULT_GPU).upper()
    if key not in GPUS:
        raise InputError(f"--gpu must be one of {', '.join(GPUS)}, got {name!r}")
    for option, value in (("--tflops", tflops), ("--hbm-gbps", hbm_gbps), ("--load-gbps", load_gbps)):
        if value is not None and not (value > 0 and value != float("inf")):
            raise InputError(f"{option} must be a positive number, got {value}")
    gpu = GPUS[key]
    return replace(gpu, tflops=tflops or gpu.tflops, hbm_gbps=hbm_gbps or gpu.hbm_gbps,
                   load_gbps=load_gbps or gpu.load_gbps)
