"""Where a store bench's time goes on GPU pages (issue 41): raw backend batches against the link, and
the protocol bench with every phase of a pass clocked. Run on the GPU machine:

    python3 gpu-sessions/store-breakdown.py OUT_DIR [--quick]

Writes OUT_DIR/raw.jsonl (one backend batch: GB/s and ratio to a contiguous pinned copy of the same
bytes, measured beside it), OUT_DIR/protocol.jsonl (one line per connector x workload x block size:
GB/s per direction and the seconds of each phase) and OUT_DIR/breakdown.txt (both as tables).
Lines are written as they are measured, so a run cut short keeps what it finished.

Phases (host clock, summed over a round): `pass` the engine's whole steps; `hooks` inside the
worker's load or save hooks (what the bench's GB/s divides by); inside those, `ops` building copy
operations, `enqueue` the backend's launch, `sync` waiting for the GPU; `forward` the fake engine's
per-layer work (fingerprint writes and checks); `meta` the scheduler's build_connector_meta.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvtool.bench import protocol_suite  # noqa: E402
from kvtool.bench.protocol_engine import Workload, block_bytes  # noqa: E402
from kvtool.connectors import store_worker  # noqa: E402
from kvtool.connectors.registry import BUILTIN_CONNECTORS  # noqa: E402
from kvtool.connectors.store_scheduler import BlockStoreScheduler  # noqa: E402
from kvtool.engine.engine import Engine  # noqa: E402
from kvtool.engine.fake_engine import FakeEngine  # noqa: E402
from kvtool.transfer import get_backend  # noqa: E402
from kvtool.transfer.api import CopyOp, PageSpace  # noqa: E402

PHASES = collections.Counter()
"""Seconds per phase, reset before each measured engine."""
HOOK_PHASE = {"start_load_kv": "load", "wait_for_layer_load": "load", "save_kv_layer": "save", "wait_for_save": "save"}


def clocked(phase: str, fn):
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            PHASES[phase] += time.perf_counter() - start
    return timed


class TimedBackend:
    """A backend whose copy and synchronize are clocked (the rest passes through)."""

    def __init__(self, inner) -> None:
        self.__dict__["_inner"] = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def copy(self, ops, stream=None):
        if PROFILER:
            PROFILER[0].enable()
        try:
            return clocked("enqueue", self._inner.copy)(ops, stream)
        finally:
            if PROFILER:
                PROFILER[0].disable()

    def synchronize(self, stream=None):
        return clocked("sync", self._inner.synchronize)(stream)


def instrument() -> None:
    real_get_backend = store_worker.get_backend
    store_worker.get_backend = lambda name, **kw: TimedBackend(real_get_backend(name, **kw))
    store_worker.BlockStoreWorker.page_ops = clocked("ops", store_worker.BlockStoreWorker.page_ops)
    Engine.step = clocked("pass", Engine.step)
    FakeEngine.forward_layer = clocked("forward", FakeEngine.forward_layer)
    BlockStoreScheduler.build_connector_meta = clocked("meta", BlockStoreScheduler.build_connector_meta)


VARIANTS = {"staged-gather": {"direct_run_bytes": 0}, "staged-runs": {"batch_runs": False}}
"""Names of this script for the staged backend as it was: `staged-gather` with its direct path off
(every host batch gathered, before issue 41), `staged-runs` with one cuMemcpyAsync per direct run
(before cuMemcpyBatchAsync)."""


def backend_variant(name: str):
    """(backend name, constructor options) for a name of this script."""
    return ("staged", VARIANTS[name]) if name in VARIANTS else (name, {})


def use_variant(name: str) -> None:
    """Make the host connector's staged backends, built from now on, the variant `name` (or the
    defaults)."""
    try:
        from kvtool.transfer import staged_backend
    except ImportError:         # no PyCUDA: no staged backend to set
        return
    if not STAGED_DEFAULTS:     # the module's own, before any variant changed them
        STAGED_DEFAULTS.update(direct_run_bytes=staged_backend.DEFAULT_DIRECT_RUN_BYTES,
                               batch_runs=staged_backend.DEFAULT_BATCH_RUNS)
    chosen = {**STAGED_DEFAULTS, **VARIANTS.get(name, {})}
    staged_backend.DEFAULT_DIRECT_RUN_BYTES = chosen["direct_run_bytes"]
    staged_backend.DEFAULT_BATCH_RUNS = chosen["batch_runs"]


STAGED_DEFAULTS: dict = {}
PROFILE = False
PROFILER: list = []
"""While a protocol run is profiled: the profiler, enabled inside the backend's copy only."""


def median_seconds(run, repeats: int) -> float:
    run()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def raw_batches(out: Path, backends: list[str], page_sizes: list[int], counts: list[int]) -> None:
    """One backend batch of `count` pages GPU pool <-> pinned store, against one contiguous copy."""
    for page_bytes in page_sizes:
        for count in counts:
            nbytes = page_bytes * count
            pool = torch.randint(0, 256, (2 * count * page_bytes,), dtype=torch.uint8, device="cuda")
            store = torch.zeros(count * page_bytes, dtype=torch.uint8, pin_memory=True)
            flat_gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            link = {"save": median_seconds(lambda s=store, g=flat_gpu: (s.copy_(g, non_blocking=True),
                                                                        torch.cuda.synchronize()), 10),
                    "load": median_seconds(lambda s=store, g=flat_gpu: (g.copy_(s, non_blocking=True),
                                                                        torch.cuda.synchronize()), 10)}
            gpu, host = PageSpace.contiguous(pool, page_bytes), PageSpace.contiguous(store, page_bytes)
            generator = torch.Generator().manual_seed(count)
            for layout, gpu_slots in (("consecutive", tuple(range(count))),
                                      ("shuffled", tuple(torch.randperm(2 * count, generator=generator)[:count]
                                                         .tolist()))):
                for name in backends:
                    try:
                        real, kwargs = backend_variant(name)
                        backend = get_backend(real, **kwargs)
                    except Exception as exc:  # noqa: BLE001 - a diagnostic: say it and go on
                        print(f"raw {name}: {exc}", flush=True)
                        continue
                    host_slots = tuple(range(count))
                    for direction in ("save", "load"):
                        op = (CopyOp(gpu, host, gpu_slots, host_slots, page_bytes) if direction == "save" else
                              CopyOp(host, gpu, host_slots, gpu_slots, page_bytes))

                        def once(backend=backend, op=op) -> None:   # timed now, bound all the same
                            backend.copy([op])
                            backend.synchronize()
                        seconds = median_seconds(once, 10)
                        ok = bool(torch.equal(store.view(count, page_bytes).cuda(),
                                              pool.view(-1, page_bytes)[list(gpu_slots)]))
                        row = {"backend": name, "page_bytes": page_bytes, "pages": count, "slots": layout,
                               "direction": direction, "us": round(seconds * 1e6, 1),
                               "gbps": round(nbytes / seconds / 1e9, 2),
                               "link_gbps": round(nbytes / link[direction] / 1e9, 2),
                               "ratio": round(link[direction] / seconds, 3), "verified": ok}
                        emit(out / "raw.jsonl", row)
                    backend = None     # freed before the next backend is built
            pool = store = flat_gpu = None
            torch.cuda.empty_cache()


def protocol_runs(out: Path, backends: list[str], workloads: list[Workload], sizes: list[int], model: str,
                  device: str, modes: list[str]) -> None:
    for workload in workloads:
        for tpb in sizes:
            for name, mode in ((n, m) for m in modes for n in backends):
                spec = BUILTIN_CONNECTORS["host"]
                probe = (workload.prompts * workload.blocks + 8) * block_bytes(model, tpb)
                options = {"backend": backend_variant(name)[0], "capacity": str(2 * probe),
                           "mode": mode}
                use_variant(name)
                PHASES.clear()
                start = time.perf_counter()
                PROFILER[:] = [cProfile.Profile()] if PROFILE else []
                try:
                    result = protocol_suite._run_block_size(spec, options, "host", model, tpb, workload, device)
                    if PROFILER:
                        write_profile(PROFILER[0], out / f"profile-{name}-{mode}-{workload.prompts}x{workload.blocks}"
                                                     f"x{workload.per_pass}-{tpb}.txt")
                except Exception:  # noqa: BLE001 - a diagnostic: say it and go on
                    print(traceback.format_exc(), flush=True)
                    continue
                wall = time.perf_counter() - start
                row = {"backend": name, "mode": mode, "prompts": workload.prompts, "blocks": workload.blocks,
                       "per_pass": workload.per_pass, "tpb": tpb, "block_bytes": result.block_bytes,
                       "issue": result.issue, "wall_s": round(wall, 3),
                       **{f"phase_{k}_ms": round(v * 1e3, 2) for k, v in sorted(PHASES.items())}}
                for direction in ("save", "load"):
                    measured = getattr(result, direction)
                    moved = measured.blocks * result.block_bytes
                    row[f"{direction}_blocks"] = measured.blocks
                    row[f"{direction}_hooks_ms"] = round(measured.seconds * 1e3, 2)
                    row[f"{direction}_gbps"] = round(moved / measured.seconds / 1e9, 2) if measured.seconds else 0
                emit(out / "protocol.jsonl", row)


def write_profile(profiler: cProfile.Profile, path: Path) -> None:
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(60)
    path.write_text(text.getvalue())


def emit(path: Path, row: dict) -> None:
    print(json.dumps(row), flush=True)
    with path.open("a") as handle:
        handle.write(json.dumps(row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--part", choices=["raw", "protocol", "all"], default="all")
    parser.add_argument("--backends", default="staged,torch,memcpy,batch,kernel")
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--modes", default="sync")
    parser.add_argument("--profile", action="store_true", help="cProfile each protocol run (OUT_DIR/profile-*.txt)")
    parser.add_argument("--raw-pages", default="16384,2097152,4194304")
    parser.add_argument("--raw-counts", default="4,32,128")
    parser.add_argument("--workloads", default="8x4x1,8x4x8,8x16x8,8x32x8", help="PROMPTSxBLOCKSxPER_PASS,...")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    backends = args.backends.split(",")
    global PROFILE
    PROFILE = args.profile
    instrument()
    if args.part in ("raw", "all"):
        raw_batches(args.out, backends, [int(p) for p in args.raw_pages.split(",")],
                    [int(c) for c in args.raw_counts.split(",")])
    if args.part in ("protocol", "all"):
        workloads = [Workload(*map(int, w.split("x"))) for w in args.workloads.split(",")]
        protocol_runs(args.out, backends, workloads, [16, 32], args.model, args.device, args.modes.split(","))


if __name__ == "__main__":
    main()
