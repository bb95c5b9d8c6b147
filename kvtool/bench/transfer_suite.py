"""The transfer sweep: every case timed against the link peak measured in the same run.

Peak: one contiguous pinned copy of the same batch size in the same direction (both directions at
once on two streams for `both`; a contiguous device copy for `gather`); on a CPU, a contiguous
memory copy. `verified`: the bytes moved by a poisoned warm-up run equal the source, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import torch

from kvtool.bench.timing import Timing, time_repeats
from kvtool.bench.workspace import Direction, Geometry, Workspace, geometry, make_workspace
from kvtool.transfer import get_backend


@dataclass(frozen=True)
class Case:
    model: str
    tokens_per_block: int
    granularity: str
    direction: Direction
    backend: str
    batch_bytes: int


@dataclass
class Row:
    backend: str
    direction: Direction
    granularity: str
    model: str
    tokens_per_block: int
    chunk_bytes: int
    batch_bytes: int
    gbps: float
    p50_us: float
    p99_us: float
    peak_gbps: float
    peak_spread: float
    """(p90 - p10) / median of the peak's repeats: how steady the baseline was."""
    ratio: float
    verified: bool

    def as_dict(self) -> dict:
        return asdict(self)


class TransferSuite:
    def __init__(self, device: torch.device, repeats: int) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.repeats = repeats
        self._workspaces: dict[tuple, Workspace] = {}
        self._peaks: dict[tuple, tuple[float, float]] = {}
        self._backends: dict[tuple[str, int], object] = {}
        self._factories: dict[str, Callable[[], object]] = {}
        self._sides: list[torch.cuda.Stream] = []

    def register(self, name: str, factory: Callable[[], object]) -> None:
        """Measure a backend configuration under its own name (e.g. a kernel variant)."""
        self._factories[name] = factory

    def run(self, cases: Iterable[Case], on_row: Callable[[Row], None] | None = None) -> list[Row]:
        rows = []
        for case in cases:
            row = self.measure(case)
            rows.append(row)
            if on_row:
                on_row(row)
        return rows

    def measure(self, case: Case) -> Row:
        g = geometry(case.model, case.tokens_per_block, case.granularity)
        ws = self.workspace(g, case.batch_bytes)
        directions = (Direction.SAVE, Direction.LOAD) if case.direction is Direction.BOTH else (case.direction,)
        runs = [self._runner(ws, d, case.backend, i) for i, d in enumerate(directions)]
        verified = True
        for direction, run in zip(directions, runs, strict=True):
            ws.poison(direction)
            run()
            self._sync()
            verified &= ws.verify(direction)
        timing = time_repeats(self._together(runs), self.repeats, self.cuda)
        moved = ws.batch_bytes * len(directions)
        peak, spread = self._peak_and_spread(ws, case.direction)
        gbps = moved / timing.median / 1e9
        return Row(case.backend, case.direction, case.granularity, case.model, case.tokens_per_block, g.nbytes,
                   moved, round(gbps, 3), round(timing.percentile_us(50), 1), round(timing.percentile_us(99), 1),
                   round(peak, 3), round(spread, 3), round(gbps / peak, 4), verified)

    def _runner(self, ws: Workspace, direction: Direction, backend_name: str, lane: int) -> Callable[[], object]:
        backend = self._backend(backend_name, lane)
        prepared = backend.prepare(ws.ops(direction))
        if self.cuda:      # joined: a staged save's bytes reach the host after its launch's ordering
            return lambda: (backend.launch(prepared), backend.join())
        return lambda: (backend.launch(prepared), backend.synchronize())

    def _backend(self, name: str, lane: int):
        """One instance per (name, lane): `both` runs saves and loads on two streams at once."""
        if (name, lane) not in self._backends:
            self._backends[(name, lane)] = self._factories.get(name, lambda: get_backend(name))()
        return self._backends[(name, lane)]

    def workspace(self, g: Geometry, batch_bytes: int) -> Workspace:
        """The buffers for `g` and `batch_bytes` on the suite's device; one kept at a time."""
        key = (g, batch_bytes)
        if key not in self._workspaces:
            self._workspaces.clear()    # one at a time: they can be gigabytes
            if self.cuda:
                torch.cuda.empty_cache()
            self._workspaces[key] = make_workspace(g, batch_bytes, self.device)
        return self._workspaces[key]

    def peak(self, ws: Workspace, direction: Direction) -> float:
        """GB/s of the same-size contiguous copy one way: the link's reference for `ws`."""
        return self._peak_and_spread(ws, direction)[0]

    def _peak_and_spread(self, ws: Workspace, direction: Direction) -> tuple[float, float]:
        """(GB/s, spread) of the same-size contiguous copy, measured once per direction and size."""
        key = (direction, ws.batch_bytes)
        if key not in self._peaks:
            self._peaks[key] = self._measure_peak(ws, direction)
        return self._peaks[key]

    def _measure_peak(self, ws: Workspace, direction: Direction) -> tuple[float, float]:
        size = ws.batch_bytes
        if not self.cuda:
            src, dst = torch.empty(size, dtype=torch.uint8).random_(0, 256), torch.empty(size, dtype=torch.uint8)
            copies: list[Callable[[], object]] = [lambda: dst.copy_(src)]
        else:
            device_buf = ws.region.tensor[:size]
            host = torch.empty(size, dtype=torch.uint8).pin_memory()
            host_in = ws.store.tensor[:size]
            device_out = ws.staging.tensor[:size]
            plans = {Direction.SAVE: [(host, device_buf)], Direction.LOAD: [(device_out, host_in)],
                     Direction.BOTH: [(host, device_buf), (device_out, host_in)],
                     Direction.GATHER: [(device_out, device_buf)]}
            copies = [self._copy(dst, src) for dst, src in plans[direction]]
        for copy in copies:
            copy()
        self._sync()
        timing: Timing = time_repeats(self._together(copies), self.repeats, self.cuda)
        spread = (timing.percentile_us(90) - timing.percentile_us(10)) / (timing.median * 1e6)
        return size * len(copies) / timing.median / 1e9, spread

    @staticmethod
    def _copy(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], object]:
        return lambda: dst.copy_(src, non_blocking=True)

    def _together(self, calls: list[Callable[[], object]]) -> Callable[[], object]:
        """Run `calls` concurrently: each on its own side stream forked from, and joined back
        into, the current stream (joining inside a call would serialise the next one)."""
        if not self.cuda or len(calls) == 1:
            return _all(calls)
        sides = self._side_streams(len(calls))

        def run() -> None:
            main = torch.cuda.current_stream()
            for side, call in zip(sides, calls, strict=True):
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    call()
            for side in sides:
                main.wait_stream(side)
        return run

    def _side_streams(self, count: int) -> list[torch.cuda.Stream]:
        while len(self._sides) < count:
            self._sides.append(torch.cuda.Stream())
        return self._sides[:count]

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def _all(calls: list[Callable[[], object]]) -> Callable[[], object]:
    def run() -> None:
        for call in calls:
            call()
    return run
