"""`--with-compute`: what a serving engine feels when a connector saves during prefill.

A bf16 matrix product loop runs on its own stream, alone and then while a backend saves on another
stream for as long as the products run; the two alternate for a few rounds and the medians are
reported, because an H200's matmul rate drifts by several percent between seconds. Reported per
variant: the products' slowdown against running alone, the transfer rate under load against the
same run's contiguous pinned copy (`ratio`), and the slowdown of the **floor** measured in the same
run: one contiguous copy-engine copy of the same bytes, the least interference a save can cause.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import cast

import torch

from kvtool.bench.workspace import Direction, Workspace, geometry, make_workspace
from kvtool.transfer import get_backend

MATMUL_SIZE = 8192
HIGH_PRIORITY = -5
LOW_PRIORITY = 0
FLOOR = "contiguous"
"""The floor's pseudo-backend: one `cudaMemcpyAsync` of the whole batch from a contiguous buffer."""


@dataclass(frozen=True)
class Variant:
    label: str
    backend: str
    options: tuple[tuple[str, object], ...] = ()
    sm_carveout: int = 0
    """SMs cuBLAS leaves free while transfers run (PyTorch's experimental carve-out), so a
    persistent matrix product is not sized for SMs the copy kernel occupies."""


FLOOR_VARIANT = Variant("floor: one contiguous copy-engine copy", FLOOR)
VARIANTS = (
    Variant("kernel 2 SMs, high priority", "kernel", (("priority", HIGH_PRIORITY), ("max_sms", 2))),
    Variant("staged, one chunk, whole-GPU gather (before)", "staged",
            (("priority", HIGH_PRIORITY), ("chunk_bytes", 0), ("gather_sms", None))),
    Variant("staged, pipelined, 8-SM gather", "staged", (("priority", HIGH_PRIORITY), ("gather_sms", 8))),
    Variant("staged, pipelined, whole-GPU gather", "staged", (("priority", HIGH_PRIORITY), ("gather_sms", None))),
    Variant("staged, one chunk, whole-GPU gather, ring of 2", "staged",
            (("priority", HIGH_PRIORITY), ("chunk_bytes", 0), ("gather_sms", None), ("ring", 2))),
    Variant("staged, one chunk, whole-GPU gather, ring of 3", "staged",
            (("priority", HIGH_PRIORITY), ("chunk_bytes", 0), ("gather_sms", None), ("ring", 3))),
    Variant("staged, pipelined, whole-GPU gather, ring of 3", "staged",
            (("priority", HIGH_PRIORITY), ("gather_sms", None), ("ring", 3))),
    Variant("staged, one chunk, whole-GPU gather, ring of 3, low priority", "staged",
            (("priority", LOW_PRIORITY), ("chunk_bytes", 0), ("gather_sms", None), ("ring", 3))),
    Variant("batch, high priority", "batch", (("priority", HIGH_PRIORITY),)),
)


@dataclass
class ComputeRow:
    variant: str
    backend: str
    direction: Direction
    model: str
    tokens_per_block: int
    chunk_bytes: int
    batch_bytes: int
    matmul_tflops_alone: float
    matmul_tflops_with_transfer: float
    matmul_slowdown: float
    floor_slowdown: float
    """The same run's floor (one contiguous copy-engine copy of the same bytes)."""
    over_floor: float
    """matmul_slowdown - floor_slowdown: what this path costs beyond the physical minimum."""
    transfer_gbps: float
    peak_gbps: float
    ratio: float
    transfer_sms: int
    rounds: int

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class _Round:
    alone_s: float
    with_transfer_s: float
    transfer_gbps: float


def measure(variant: Variant, model: str, tokens_per_block: int, granularity: str, batch_bytes: int,
            peak_gbps: float, floor_slowdown: float | None = None, rounds: int = 3,
            num_matmuls: int = 60) -> ComputeRow:
    """One variant's row; `floor_slowdown` None measures the floor itself (and reports it as its own)."""
    ws = make_workspace(geometry(model, tokens_per_block, granularity), batch_bytes, torch.device("cuda"))
    launch, finish, sms = _launcher(variant, ws)
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device="cuda", dtype=torch.bfloat16)
    compute_stream, transfer_caller = torch.cuda.Stream(), torch.cuda.Stream()
    _matmuls(compute_stream, a, b, 5)
    _transfers(transfer_caller, launch, finish, 1)      # warm: the first launch is cold
    torch.cuda.synchronize()
    per_batch = _transfers(transfer_caller, launch, finish, 5)
    torch.cuda.synchronize()
    results = [_round(variant, compute_stream, transfer_caller, (launch, finish), a, b, num_matmuls,
                      per_batch.elapsed() / 5, ws) for _ in range(rounds)]
    alone = statistics.median(r.alone_s for r in results)
    slowdown = statistics.median(r.with_transfer_s / r.alone_s - 1 for r in results)
    gbps = statistics.median(r.transfer_gbps for r in results)
    loaded = statistics.median(r.with_transfer_s for r in results)
    flops = 2 * MATMUL_SIZE ** 3 * num_matmuls
    floor = slowdown if floor_slowdown is None else floor_slowdown
    return ComputeRow(variant.label, variant.backend, Direction.SAVE, model, tokens_per_block, ws.geometry.nbytes,
                      ws.batch_bytes, round(flops / alone / 1e12, 1), round(flops / loaded / 1e12, 1),
                      round(slowdown, 4), round(floor, 4), round(slowdown - floor, 4), round(gbps, 3),
                      round(peak_gbps, 3), round(gbps / peak_gbps, 4), sms, rounds)


def _round(variant: Variant, compute_stream, transfer_caller,
           calls: tuple[Callable[[], object], Callable[[], object]], a, b, num_matmuls: int, batch_s: float,
           ws: Workspace) -> _Round:
    """Products alone, then products with saves running for their whole duration."""
    alone = _matmuls(compute_stream, a, b, num_matmuls)
    torch.cuda.synchronize()
    repeats = max(1, int(alone.elapsed() / batch_s * 1.1))
    with _carveout(variant.sm_carveout):
        _matmuls(compute_stream, a, b, 3)      # cuBLAS picks its kernels for the carve-out
        torch.cuda.synchronize()
        with_matmul = _matmuls(compute_stream, a, b, num_matmuls)
        under_load = _transfers(transfer_caller, *calls, repeats)
        torch.cuda.synchronize()
    return _Round(alone.elapsed(), with_matmul.elapsed(), ws.batch_bytes * repeats / under_load.elapsed() / 1e9)


def _launcher(variant: Variant, ws: Workspace) -> tuple[Callable[[], object], Callable[[], object], int]:
    """(launch one batch on the current stream, order the current stream after every byte landed,
    SMs the path occupies; 0 for a whole-GPU gather that runs only between the products' kernels)."""
    if variant.backend == FLOOR:
        source = ws.region.tensor[:ws.batch_bytes]
        host = torch.empty(ws.batch_bytes, dtype=torch.uint8).pin_memory()
        return (lambda: host.copy_(source, non_blocking=True)), (lambda: None), 0
    backend = get_backend(variant.backend, **dict(variant.options))
    prepared = backend.prepare(ws.ops(Direction.SAVE))
    sms = cast(int, getattr(backend, "gather_sms", None) or getattr(backend, "max_sms", 0))   # CUDA backends' SMs
    return (lambda: backend.launch(prepared)), backend.join, sms


@contextlib.contextmanager
def _carveout(num_sms: int):
    setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if not num_sms or setter is None:
        yield
        return
    before = torch._C._get_sm_carveout_experimental()
    setter(num_sms)
    try:
        yield
    finally:
        setter(before)


class _Span:
    def __init__(self) -> None:
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def elapsed(self) -> float:
        return self.start.elapsed_time(self.end) / 1e3


def _matmuls(stream: torch.cuda.Stream, a: torch.Tensor, b: torch.Tensor, count: int) -> _Span:
    span = _Span()
    with torch.cuda.stream(stream):
        span.start.record()
        for _ in range(count):
            torch.mm(a, b)
        span.end.record()
    return span


def _transfers(caller: torch.cuda.Stream, launch: Callable[[], object], finish: Callable[[], object],
               count: int) -> _Span:
    """`count` batches back to back; the span ends when the last byte has landed."""
    span = _Span()
    with torch.cuda.stream(caller):
        span.start.record()
        for _ in range(count):
            launch()
        finish()
        span.end.record()
    return span
