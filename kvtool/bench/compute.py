"""`--with-compute`: what a serving engine feels when a connector saves during prefill.

A bf16 matrix product loop runs on its own stream, first alone, then while the backend saves on a
high-priority stream for as long as the products run. Reported: the products' slowdown against
running alone, and the transfer rate under load against the same run's contiguous pinned copy.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass

import torch

from kvtool.bench.workspace import Direction, geometry, make_workspace
from kvtool.transfer import get_backend

MATMUL_SIZE = 8192
HIGH_PRIORITY = -5


@dataclass(frozen=True)
class Variant:
    label: str
    backend: str
    options: tuple[tuple[str, object], ...] = ()
    sm_carveout: int = 0
    """SMs cuBLAS leaves free while transfers run (PyTorch's experimental carve-out), so a
    persistent matrix product is not sized for SMs the copy kernel occupies."""


VARIANTS = (
    Variant("kernel 8 SMs, high priority", "kernel", (("priority", HIGH_PRIORITY),)),
    Variant("kernel 2 SMs, high priority", "kernel", (("priority", HIGH_PRIORITY), ("max_sms", 2))),
    Variant("kernel 8 SMs, default priority", "kernel", ()),
    Variant("kernel 8 SMs, high priority, cuBLAS carve-out 8", "kernel", (("priority", HIGH_PRIORITY),), 8),
    Variant("kernel 2 SMs, high priority, cuBLAS carve-out 2", "kernel", (("priority", HIGH_PRIORITY),
                                                                         ("max_sms", 2)), 2),
    Variant("staged, high priority", "staged", (("priority", HIGH_PRIORITY),)),
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
    transfer_gbps: float
    peak_gbps: float
    ratio: float
    transfer_sms: int

    def as_dict(self) -> dict:
        return asdict(self)


def measure(variant: Variant, model: str, tokens_per_block: int, granularity: str, batch_bytes: int,
            peak_gbps: float, num_matmuls: int = 60) -> ComputeRow:
    ws = make_workspace(geometry(model, tokens_per_block, granularity), batch_bytes, torch.device("cuda"))
    backend = get_backend(variant.backend, **dict(variant.options))
    prepared = backend.prepare(ws.ops(Direction.SAVE))
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device="cuda", dtype=torch.bfloat16)
    compute_stream, transfer_caller = torch.cuda.Stream(), torch.cuda.Stream()
    flops = 2 * MATMUL_SIZE ** 3 * num_matmuls
    _matmuls(compute_stream, a, b, 5)
    torch.cuda.synchronize()
    alone = _matmuls(compute_stream, a, b, num_matmuls)
    torch.cuda.synchronize()
    per_batch = _transfers(transfer_caller, backend, prepared, 5)
    torch.cuda.synchronize()
    repeats = max(1, int(alone.elapsed() / per_batch.elapsed() * 5 * 1.1))
    with _carveout(variant.sm_carveout):
        _matmuls(compute_stream, a, b, 3)      # cuBLAS picks its kernels for the carve-out
        torch.cuda.synchronize()
        with_matmul = _matmuls(compute_stream, a, b, num_matmuls)
        under_load = _transfers(transfer_caller, backend, prepared, repeats)
        torch.cuda.synchronize()
    gbps = ws.batch_bytes * repeats / under_load.elapsed() / 1e9
    return ComputeRow(variant.label, variant.backend, Direction.SAVE, model, tokens_per_block, ws.geometry.nbytes, ws.batch_bytes,
                      round(flops / alone.elapsed() / 1e12, 1), round(flops / with_matmul.elapsed() / 1e12, 1),
                      round(with_matmul.elapsed() / alone.elapsed() - 1, 4), round(gbps, 3), round(peak_gbps, 3),
                      round(gbps / peak_gbps, 4), getattr(backend, "max_sms", 0))


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


def _transfers(caller: torch.cuda.Stream, backend, prepared, count: int) -> _Span:
    span = _Span()
    with torch.cuda.stream(caller):
        span.start.record()
        for _ in range(count):
            backend.launch(prepared)
        span.end.record()
    return span
