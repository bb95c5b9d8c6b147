"""The layer-by-layer plan and the raw 16 KB paths on the GPU, every setting against the same run's link.

    python -m benchmarks.layer_plan_sweep --output DIR [--repeats 5] [--part layers,raw]

`layers`: one pass of the host connector's layerwise copies as the connector makes them
(llama-3.1-8b, 128 pages of 16 or 32 tokens, 32 layers: one batch per layer, every page's chunk of
that layer, `prepare_layers` once per pass), saved and loaded with pages and store rows in order
or shuffled. Per variant (staged settings, layers spread over 1 or 2 backends = copy streams, the
`kernel` backend): host ms to prepare the pass's 32 batches, host µs per launch, and GB/s of the 32
launches back to back on the GPU clock (events on the launching stream around them), over one
contiguous pinned copy of the same bytes in the same direction (`link`). Every byte verified after
a poisoned run (the 32 chunks of a page cover it whole).

`raw`: `TransferSuite` cases at 16 KB chunks (llama-3.1-8b at 4 tokens a block, one layer's K and V;
64 MiB batches of random pages into consecutive rows) for staged and kernel variants.

Writes DIR/layers.jsonl and DIR/raw.jsonl, a line per case as measured, and a table to stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvtool.transfer.api import CopyOp, PageSpace

NUM_LAYERS = 32
NUM_PAGES = 128
PAGE_BYTES = {16: 2 << 20, 32: 4 << 20}       # llama-3.1-8b: 32 layers x K,V x tpb x 8 heads x 128 x 2 B
LAYER_VARIANTS: dict[str, tuple[str, dict, int]] = {     # name: (backend, options, backends = copy streams)
    "staged": ("staged", {}, 1),
    "staged-2-streams": ("staged", {}, 2),
    "staged-gather": ("staged", {"direct_run_bytes": 0}, 1),
    "staged-gather-one-chunk": ("staged", {"direct_run_bytes": 0, "chunk_bytes": 0}, 1),
    "staged-gather-first-256KiB": ("staged", {"direct_run_bytes": 0, "first_chunk_bytes": 256 << 10}, 1),
    "staged-gather-2-streams": ("staged", {"direct_run_bytes": 0}, 2),
    "staged-no-batch": ("staged", {"batch_runs": False}, 1),
    "kernel": ("kernel", {}, 1),
}
RAW_VARIANTS: dict[str, tuple[str, dict]] = {
    "staged": ("staged", {}),
    "staged-16MiB": ("staged", {"chunk_bytes": 16 << 20}),
    "staged-32MiB-first-4MiB": ("staged", {"chunk_bytes": 32 << 20, "first_chunk_bytes": 4 << 20}),
    "staged-16MiB-first-256KiB": ("staged", {"chunk_bytes": 16 << 20, "first_chunk_bytes": 256 << 10}),
    "kernel": ("kernel", {}),
    "kernel-12sm": ("kernel", {"max_sms": 12}),
    "kernel-16sm": ("kernel", {"max_sms": 16}),
    "kernel-24sm": ("kernel", {"max_sms": 24}),
    "kernel-16sm-unroll16": ("kernel", {"max_sms": 16, "unroll": 16}),
    "kernel-8sm-unroll16": ("kernel", {"max_sms": 8, "unroll": 16}),
}


def backend(kind: str, options: dict):
    from kvtool.transfer.kernel_backend import KernelBackend
    from kvtool.transfer.staged_backend import StagedBackend
    return (StagedBackend if kind == "staged" else KernelBackend)(**options)


def median_gpu_seconds(run: Callable[[torch.cuda.Stream], None], stream: torch.cuda.Stream, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        run(stream)
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def link_gbps(nbytes: int, save: bool, repeats: int) -> float:
    gpu = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    src, dst = (gpu, host) if save else (host, gpu)
    stream = torch.cuda.Stream()

    def copy(s):
        with torch.cuda.stream(s):
            dst.copy_(src, non_blocking=True)
    copy(stream)
    return nbytes / median_gpu_seconds(copy, stream, repeats) / 1e9


_SPACES: dict[int, tuple[PageSpace, PageSpace]] = {}


def spaces(tpb: int) -> tuple[PageSpace, PageSpace]:
    """The GPU pages and the pinned store of one block size (made once: random bytes, never zeros)."""
    if tpb not in _SPACES:
        page = PAGE_BYTES[tpb]
        gpu = torch.randint(0, 256, ((NUM_PAGES + 2) * page,), dtype=torch.uint8, device="cuda")
        host = torch.empty(gpu.numel(), dtype=torch.uint8, pin_memory=True)
        host.copy_(torch.randint(0, 256, gpu.shape, dtype=torch.uint8, device="cuda"))
        _SPACES[tpb] = PageSpace.contiguous(gpu, page), PageSpace.contiguous(host, page)
    return _SPACES[tpb]


def layer_case(tpb: int, save: bool, shuffled: bool, name: str, repeats: int, link: float) -> dict:
    kind, options, num_backends = LAYER_VARIANTS[name]
    page = PAGE_BYTES[tpb]
    chunk = page // NUM_LAYERS
    gen = torch.Generator().manual_seed(tpb)
    gpu, host = spaces(tpb)
    pages = tuple(torch.randperm(NUM_PAGES + 2, generator=gen)[:NUM_PAGES].tolist()) if shuffled else \
        tuple(range(NUM_PAGES))
    rows = tuple(torch.randperm(NUM_PAGES + 2, generator=gen)[:NUM_PAGES].tolist()) if shuffled else \
        tuple(range(2, NUM_PAGES + 2))
    src, dst, src_slots, dst_slots = (gpu, host, pages, rows) if save else (host, gpu, rows, pages)
    layers = [[CopyOp(src, dst, src_slots, dst_slots, chunk, i * chunk, i * chunk)] for i in range(NUM_LAYERS)]
    backends = [backend(kind, options) for _ in range(num_backends)]
    started = time.perf_counter()
    prepared = [b.prepare_layers(layers[k::num_backends]) for k, b in enumerate(backends)]
    prepare_ms = (time.perf_counter() - started) * 1e3
    launch_s: list[float] = []

    def one_pass(stream):
        begun = time.perf_counter()
        for layer in range(NUM_LAYERS):
            k = layer % num_backends
            backends[k].launch(prepared[k][layer // num_backends], stream)
        launch_s.append(time.perf_counter() - begun)
        for b in backends:
            b.join(stream)
    stream = torch.cuda.Stream()
    src.tensor.copy_(torch.randint(0, 256, src.tensor.shape, dtype=torch.uint8, device="cuda"))
    dst.tensor.fill_(0xA5)
    torch.cuda.synchronize()
    one_pass(stream)
    torch.cuda.synchronize()
    src_rows = src.tensor.view(-1, page)[list(src_slots)].cpu()
    verified = torch.equal(dst.tensor.view(-1, page)[list(dst_slots)].cpu(), src_rows)
    seconds = median_gpu_seconds(one_pass, stream, repeats)
    gbps = NUM_PAGES * page / seconds / 1e9
    return {"tpb": tpb, "direction": "save" if save else "load", "order": "shuffled" if shuffled else "in order",
            "variant": name, "gbps": round(gbps, 2), "link_gbps": round(link, 2), "ratio": round(gbps / link, 4),
            "prepare_ms": round(prepare_ms, 2), "launch_us": round(statistics.median(launch_s) / NUM_LAYERS * 1e6, 1),
            "verified": verified}


def run_layers(out: Path, repeats: int) -> None:
    with (out / "layers.jsonl").open("a") as log:
        for tpb in PAGE_BYTES:
            for save in (True, False):
                link = link_gbps(NUM_PAGES * PAGE_BYTES[tpb], save, repeats * 2)
                for shuffled in (False, True):
                    for name in LAYER_VARIANTS:
                        try:
                            row = layer_case(tpb, save, shuffled, name, repeats, link)
                        except Exception as exc:    # noqa: BLE001 - one broken variant must not cost the others
                            row = {"tpb": tpb, "variant": name, "error": f"{type(exc).__name__}: {exc}"}
                        print(json.dumps(row), flush=True)
                        log.write(json.dumps(row) + "\n")
                        log.flush()


def run_raw(out: Path, repeats: int) -> None:
    from kvtool.bench.transfer_suite import Case, TransferSuite
    from kvtool.bench.workspace import Direction
    suite = TransferSuite(torch.device("cuda"), repeats)
    for name, (kind, options) in RAW_VARIANTS.items():
        suite.register(name, lambda k=kind, o=options: backend(k, o))
    with (out / "raw.jsonl").open("a") as log:
        for direction in (Direction.SAVE, Direction.LOAD):
            for name in RAW_VARIANTS:
                try:
                    row = suite.measure(Case("llama-3.1-8b", 4, "layer", direction, name, 64 << 20)).as_dict()
                    row["direction"] = str(row["direction"])
                except Exception as exc:    # noqa: BLE001
                    row = {"variant": name, "direction": str(direction), "error": f"{type(exc).__name__}: {exc}"}
                print(json.dumps(row), flush=True)
                log.write(json.dumps(row) + "\n")
                log.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--part", default="layers,raw")
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    parts = set(args.part.split(","))
    if "layers" in parts:
        run_layers(args.output, args.repeats)
    if "raw" in parts:
        run_raw(args.output, args.repeats * 4)


if __name__ == "__main__":
    main()
