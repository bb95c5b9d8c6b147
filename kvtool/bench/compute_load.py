"""A matrix-product loop that runs beside a connector, and the wall-clock interval of every product.

`--suite store --with-compute` asks what a connector's saves cost a prefill computing at the same
time. The engine drives the connector on its own thread; `MatmulLoad` runs products back to back on
a thread of its own and records when each one ran, so that each product can be set against the
intervals in which the connector was saving (the engine's hooks, timed on the host's clock).

On a GPU: bf16 products on a stream of their own, timed by CUDA events; a few stay queued so the
GPU never waits for the thread (which shares the interpreter with the engine), and the events are
put on the host's clock through one anchor event taken at a synchronised instant (error: the
latency of one synchronisation, tens of µs). On a CPU: fp32 products run by the thread itself
(PyTorch releases the interpreter inside them), timed by the host's clock.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass

import torch

GPU_MATMUL = 4096
"""A product of 137 GFLOP: about 0.2 ms on an H200, short against a block's save, still filling every SM."""
CPU_MATMUL = 256
GPU_QUEUE_DEPTH = 8
"""Products queued ahead: 8 x 0.2 ms outlasts the interpreter's 5 ms switch interval."""


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
        size = GPU_MATMUL if device.type == "cuda" else CPU_MATMUL
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.size = size
        self.a = torch.randn(size, size, device=device, dtype=dtype)
        self.b = torch.randn(size, size, device=device, dtype=dtype)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._products: list[Product] = []
        self._error: BaseException | None = None

    @property
    def flops(self) -> float:
        """Floating-point operations of one product."""
        return 2.0 * self.size ** 3

    def describe(self) -> str:
        """E.g. `bf16 4096³ on cuda`: the products' type, size and device."""
        kind = "bf16" if self.device.type == "cuda" else "fp32"
        return f"{kind} {self.size}³ on {self.device.type}"

    def start(self) -> None:
        self._stop.clear()
        self._products, self._error = [], None
        self._thread = threading.Thread(target=self._run, name="kvtool-matmul-load", daemon=True)
        self._thread.start()

    def stop(self) -> list[Product]:
        """Stop after the products in flight; their intervals. Re-raises what the loop raised."""
        assert self._thread is not None, "stop() without start()"
        self._stop.set()
        self._thread.join()
        self._thread = None
        if self._error is not None:
            raise self._error
        return self._products

    def run_for(self, seconds: float) -> list[Product]:
        """Products alone for about `seconds` (the caller keeps everything else idle)."""
        self.start()
        time.sleep(seconds)
        return self.stop()

    def _run(self) -> None:
        try:
            self._products = self._gpu_loop() if self.device.type == "cuda" else self._cpu_loop()
        except BaseException as exc:  # noqa: BLE001 - handed to stop() on the caller's thread
            self._error = exc

    def _cpu_loop(self) -> list[Product]:
        products = []
        while not self._stop.is_set():
            start = time.perf_counter()
            torch.mm(self.a, self.b)
            products.append(Product(start, time.perf_counter()))
        return products

    def _gpu_loop(self) -> list[Product]:
        stream = torch.cuda.Stream(device=self.device)
        anchor, anchor_host = _anchor(stream)
        events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        with torch.cuda.stream(stream):
            while not self._stop.is_set():
                if len(events) >= GPU_QUEUE_DEPTH:
                    events[-GPU_QUEUE_DEPTH][1].synchronize()
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                torch.mm(self.a, self.b)
                end.record()
                events.append((begin, end))
        stream.synchronize()
        return [Product(anchor_host + anchor.elapsed_time(b) / 1e3, anchor_host + anchor.elapsed_time(e) / 1e3)
                for b, e in events]


def _anchor(stream: torch.cuda.Stream) -> tuple[torch.cuda.Event, float]:
    """An event on `stream` and the host instant it completed (the stream idle before it)."""
    stream.synchronize()
    anchor = torch.cuda.Event(enable_timing=True)
    anchor.record(stream)
    anchor.synchronize()
    return anchor, time.perf_counter()


def overlap(product: Product, spans: list[tuple[float, float]]) -> float:
    """The fraction of `product`'s interval covered by `spans` (disjoint, sorted)."""
    covered = sum(max(0.0, min(product.end, e) - max(product.start, s)) for s, e in spans)
    return covered / product.seconds if product.seconds > 0 else 0.0


@dataclass(frozen=True)
class Split:
    """A loaded run's products by what ran beside them."""

    during: list[Product]
    """At least half their time inside the spans (the connector moving bytes)."""
    outside: list[Product]
    """Inside the window, none of their time inside the spans (the engine's own work only)."""


def split(products: list[Product], spans: list[tuple[float, float]], window: tuple[float, float]) -> Split:
    """Products inside `window` by their overlap with `spans`; the partly covered rest is left out."""
    inside = [p for p in products if p.start >= window[0] and p.end <= window[1]]
    during = [p for p in inside if overlap(p, spans) >= 0.5]
    outside = [p for p in inside if overlap(p, spans) == 0.0]
    return Split(during, outside)


def median_seconds(products: list[Product]) -> float | None:
    return statistics.median(p.seconds for p in products) if products else None
