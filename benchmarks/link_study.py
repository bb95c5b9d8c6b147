"""The link study: every transfer path against the same run's physical limits, in one run.

    python -m benchmarks.link_study --output results/NAME [--repeats 20] [--batch-bytes 64MiB]

What it measures, for 16 KB (a layer's K and V of a 4-token llama-3.1-8b block) and 512 KB (the
whole page) chunks:
- saves, loads and both at once per path, against a contiguous pinned copy of the same bytes (and
  the two-stream bidirectional copy for `both`); GPU gathers against a contiguous device copy;
- a bf16 matmul's slowdown while each path saves, against the **floor**: one contiguous
  copy-engine copy of the same bytes running beside the same matmul.
Every moved byte is verified (a poisoned run compared with its source). Writes results.csv (the
transfers), compute.csv, results.json and meta.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from kvtool.bench import compute
from kvtool.bench.transfer_suite import Case, TransferSuite
from kvtool.bench.workspace import Direction, geometry
from kvtool.report.bench_plot import plot
from kvtool.report.bench_report import write_run
from kvtool.report.run_folder import prepare_run_folder, settled_run_folders
from kvtool.units import parse_size

MODEL, TOKENS_PER_BLOCK = "llama-3.1-8b", 4
GRANULARITIES = ("layer", "slot")         # 16 KB and 512 KB chunks
PATHS: dict[str, dict] = {
    "staged-before": {"chunk_bytes": 0, "gather_sms": None},
    "staged-4MiB-flat": {"chunk_bytes": 4 << 20, "first_chunk_bytes": 4 << 20},
    "staged": {},
    "staged-graphed": {"graphed": True},
    "staged-8sm-gather": {"gather_sms": 8},
    "staged-16MiB": {"chunk_bytes": 16 << 20},
    "staged-first-256KiB": {"first_chunk_bytes": 256 << 10},
}
GATHER_PATHS: dict[str, dict] = {"kernel-graphed": {"graphed": True},
                                 "kernel-graphed-4-per-sm": {"graphed": True, "device_blocks_per_sm": 4}}
PLAIN = ("kernel", "batch")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--batch-bytes", default="64MiB")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--skip-compute", action="store_true")
    args = parser.parse_args()
    out = prepare_run_folder(args.output.resolve(), "bench")
    batch = parse_size(args.batch_bytes)
    suite = _suite(args.repeats)
    rows = []
    for case in _cases(batch):
        try:
            row = suite.measure(case).as_dict()
        except Exception as exc:    # noqa: BLE001 - one broken path must not cost the others' figures
            row = {"backend": case.backend, "direction": str(case.direction), "granularity": case.granularity,
                   "error": f"{type(exc).__name__}: {exc}"}
        print(row, flush=True)
        rows.append(row)
    extra = {} if args.skip_compute else {"compute": _compute_rows(suite, batch)}
    measured = [r for r in rows if "error" not in r]
    if measured:
        plot(measured, out / "gbps_vs_chunk.png", torch.cuda.get_device_name())
    write_run(out, rows, extra, "link-study")
    print(f"results in {out}")


def _suite(repeats: int) -> TransferSuite:
    from kvtool.transfer.kernel_backend import KernelBackend
    from kvtool.transfer.staged_backend import StagedBackend
    suite = TransferSuite(torch.device("cuda"), repeats)
    for name, options in PATHS.items():
        suite.register(name, lambda o=options: StagedBackend(**o))
    for name, options in GATHER_PATHS.items():
        suite.register(name, lambda o=options: KernelBackend(**o))
    return suite


def _cases(batch: int) -> list[Case]:
    cases = []
    for granularity in GRANULARITIES:
        for direction in (Direction.SAVE, Direction.LOAD, Direction.BOTH):
            for name in (*PATHS, *PLAIN):
                cases.append(Case(MODEL, TOKENS_PER_BLOCK, granularity, direction, name, batch))
        for name in ("kernel", *GATHER_PATHS, "staged"):
            cases.append(Case(MODEL, TOKENS_PER_BLOCK, granularity, Direction.GATHER, name, batch))
    return cases


def _compute_rows(suite: TransferSuite, batch: int) -> list[dict]:
    rows = []
    for granularity in GRANULARITIES:
        ws = suite.workspace(geometry(MODEL, TOKENS_PER_BLOCK, granularity), batch)
        peak = suite.peak(ws, Direction.SAVE)
        floor = compute.measure(compute.FLOOR_VARIANT, MODEL, TOKENS_PER_BLOCK, granularity, batch, peak, rounds=5)
        rows.append(floor.as_dict())
        print(rows[-1], flush=True)
        for variant in compute.VARIANTS:
            try:
                row = compute.measure(variant, MODEL, TOKENS_PER_BLOCK, granularity, batch, peak,
                                      floor.matmul_slowdown, rounds=5).as_dict()
            except Exception as exc:    # noqa: BLE001
                row = {"variant": variant.label, "granularity": granularity, "error": f"{type(exc).__name__}: {exc}"}
            print(row, flush=True)
            rows.append(row)
    return rows


if __name__ == "__main__":
    with settled_run_folders():
        main()
