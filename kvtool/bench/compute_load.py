"""A matrix-product loop that runs beside a connector, and the wall-clock interval of every product.

`--suite store --with-compute` asks what a connector's saves cost a prefill computing at the same
time. The engine drives the connector on its own thread; `MatmulLoad` runs products back to back on
a thread of its own and records when each one ran, so that each product can be set against the
intervals in which the connector was saving (the engine's hooks, timed on the host's clock).

On a GPU, one *product* is `GPU_BATCH` bf16 matrix products between two CUDA events on a stream of
the load's own. The thread shares the interpreter with the engine, and the interpreter can hold it
for milliseconds (its switch interval is 5 ms), so:
- about 20 ms of products stay queued, so the GPU does not wait for the thread;
- a product whose begin event ran before its last launch returned is dropped: the stream may have
  idled inside it while the thread waited for the interpreter, which is not the GPU's time;
- the events are put on the host's clock by one anchor event recorded on the caller's thread before
  the load starts (the stream idle), between two host readings less than `ANCHOR_BRACKET_S` apart.
On a CPU, fp32 products run on the thread itself and are timed by the host's clock; they also wait
for the interpreter while the engine's Python runs, so a CPU run exercises the path and shows the
interpreter's share, not what a GPU would feel.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass

import torch

from kvtool.errors import KvToolError

GPU_MATMUL = 4096
"""137 GFLOP a product: about 0.2 ms on an H200, still filling every SM."""
GPU_BATCH = 4
"""Products between two events: about 0.8 ms, short against most saves, few interpreter hand-offs."""
GPU_QUEUE_DEPTH = 24
"""Batches queued ahead: about 20 ms, past the interpreter's 5 ms switch interval."""
CPU_MATMUL = 256
ANCHOR_BRACKET_S = 50e-6


class ComputeLoadError(KvToolError):
    """The products beside the connector failed (not the connector)."""


@dataclass(frozen=True)
class Product:
    start: float
    end: float
    """Host clock (`time.perf_counter`) seconds."""

    @property
    def seconds(self) -> float:
        return self.end - self.start


class MatmulLoad:
    """Products back to back on `device` from `start()` to `stop()`; `stop()` returns each product's
    interval on the host clock, in launch order. One load runs at a time per instance."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        cuda = device.type == "cuda"
        self.size = GPU_MATMUL if cuda else CPU_MATMUL
        self.batch = GPU_BATCH if cuda else 1
        dtype = torch.bfloat16 if cuda else torch.float32
        self.a = torch.randn(self.size, self.size, device=device, dtype=dtype)
        self.b = torch.randn(self.size, self.size, device=device, dtype=dtype)
        self._stream = torch.cuda.Stream(device=device) if cuda else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._products: list[Product] = []
        self._error: BaseException | None = None
        self.dropped = 0
        """GPU batches the last load dropped (module docstring): reported, so a row built on few
        products says so."""

    def describe(self) -> str:
        """E.g. `bf16 4096³ x4 on cuda`: the products' type, size, batch and device."""
        kind = "bf16" if self.device.type == "cuda" else "fp32"
        return f"{kind} {self.size}³{f' x{self.batch}' if self.batch > 1 else ''} on {self.device.type}"

    def start(self) -> None:
        """Start the products (on a GPU, after anchoring its clock on the caller's thread)."""
        self._stop.clear()
        self._products, self._error, self.dropped = [], None, 0
        try:
            anchor = _anchor(self._stream) if self._stream is not None else None
        except Exception as exc:  # noqa: BLE001 - the products' failure, not the connector's
            raise ComputeLoadError(f"the products beside the connector could not start: {type(exc).__name__}: "
                                   f"{exc}") from exc
        self._thread = threading.Thread(target=self._run, args=(anchor,), name="kvtool-matmul-load", daemon=True)
        self._thread.start()

    def stop(self, quiet: bool = False) -> list[Product]:
        """Stop after the products in flight; their intervals. ComputeLoadError for what the loop
        raised, unless `quiet` (the caller is already failing for another reason)."""
        assert self._thread is not None, "stop() without start()"
        self._stop.set()
        self._thread.join()
        self._thread = None
        if self._error is not None and not quiet:
            raise ComputeLoadError(f"the products beside the connector failed: {type(self._error).__name__}: "
                                   f"{self._error}") from self._error
        return self._products

    def run_for(self, seconds: float) -> list[Product]:
        """Products alone for about `seconds` (the caller keeps everything else idle)."""
        self.start()
        time.sleep(seconds)
        return self.stop()

    def _run(self, anchor) -> None:
        try:
            self._products = self._gpu_loop(*anchor) if anchor is not None else self._cpu_loop()
        except BaseException as exc:  # noqa: BLE001 - handed to stop() on the caller's thread
            self._error = exc

    def _cpu_loop(self) -> list[Product]:
        products = []
        while not self._stop.is_set():
            start = time.perf_counter()
            torch.mm(self.a, self.b)
            products.append(Product(start, time.perf_counter()))
        return products

    def _gpu_loop(self, anchor: torch.cuda.Event, anchor_host: float) -> list[Product]:
        """(begin, end, host time after the batch's last launch) per batch, on the host clock;
        batches whose begin ran before that time are dropped (module docstring)."""
        assert self._stream is not None   # anchored: this runs on a GPU only
        batches: list[tuple[torch.cuda.Event, torch.cuda.Event, float]] = []
        with torch.cuda.stream(self._stream):
            while not self._stop.is_set():
                if len(batches) >= GPU_QUEUE_DEPTH:
                    batches[-GPU_QUEUE_DEPTH][1].synchronize()
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                for _ in range(self.batch):
                    torch.mm(self.a, self.b)
                end.record()
                batches.append((begin, end, time.perf_counter()))
        self._stream.synchronize()

        def host(event: torch.cuda.Event) -> float:
            return anchor_host + anchor.elapsed_time(event) / 1e3
        kept = [Product(host(b), host(e)) for b, e, launched in batches if host(b) >= launched]
        self.dropped = len(batches) - len(kept)
        return kept


def _anchor(stream: torch.cuda.Stream, tries: int = 20) -> tuple[torch.cuda.Event, float]:
    """An event recorded on the idle `stream`, and the host instant it ran: the middle of the
    tightest bracket of host readings around its record and completion (error: half of it)."""
    stream.synchronize()
    best: tuple[float, torch.cuda.Event, float] | None = None
    for _ in range(tries):
        anchor = torch.cuda.Event(enable_timing=True)
        before = time.perf_counter()
        anchor.record(stream)
        anchor.synchronize()
        after = time.perf_counter()
        if best is None or after - before < best[0]:
            best = (after - before, anchor, (before + after) / 2)
        if after - before < ANCHOR_BRACKET_S:
            break
    assert best is not None   # tries >= 1: the first try sets it
    return best[1], best[2]


def overlap(product: Product, spans: list[tuple[float, float]]) -> float:
    """The fraction of `product`'s interval covered by `spans` (disjoint, sorted)."""
    covered = sum(max(0.0, min(product.end, e) - max(product.start, s)) for s, e in spans)
    return covered / product.seconds if product.seconds > 0 else 0.0


def during(products: list[Product], spans: list[tuple[float, float]], window: tuple[float, float]) -> list[Product]:
    """The products inside `window` with at least half their time inside `spans`."""
    return [p for p in products if window[0] <= p.start and p.end <= window[1] and overlap(p, spans) >= 0.5]


def median_seconds(products: list[Product]) -> float | None:
    return statistics.median(p.seconds for p in products) if products else None
