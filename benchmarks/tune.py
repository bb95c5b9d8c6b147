"""Kernel tuning sweep: SMs used and loads in flight per lane, against the same run's peak.

    python -m benchmarks.tune [--batch-bytes 64MiB] [--repeats 10]

Prints one row per (variant, direction, chunk size); the defaults of the `kernel` backend come from
this sweep on the target GPU.
"""

from __future__ import annotations

import argparse
import json

import torch

from kvtool.bench.transfer_suite import Case, TransferSuite
from kvtool.bench.workspace import Direction
from kvtool.units import parse_size

VARIANTS = [(sms, unroll, hint, 1024) for sms in (2, 4, 8, 16) for unroll in (4, 8) for hint in (0, 1)]
SHAPES = [("llama-3.1-8b", 4, "layer"), ("llama-3.1-8b", 16, "layer"), ("llama-3.1-8b", 4, "slot")]
GATHER_VARIANTS = [(threads, per_sm, unroll, load, store) for threads in (256, 512, 1024) for per_sm in (2, 4, 8)
                   for unroll in (4, 8) for load in (0, 3) for store in (0, 1)
                   if threads * per_sm <= 4096]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-bytes", default="64MiB")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--gather", action="store_true", help="Sweep GPU-to-GPU gather variants instead.")
    args = parser.parse_args()
    if args.gather:
        gather_sweep(parse_size(args.batch_bytes), args.repeats)
        return
    from kvtool.transfer.kernel_backend import KernelBackend
    suite = TransferSuite(torch.device("cuda"), args.repeats)
    names = []
    for sms, unroll, hint, threads in VARIANTS:
        name = f"kernel-{sms}sm-u{unroll}-h{hint}-t{threads}"
        names.append(name)
        suite.register(name, lambda s=sms, u=unroll, h=hint, t=threads: KernelBackend(
            max_sms=s, unroll=u, load_hint=h, host_threads=t))
    for model, tpb, granularity in SHAPES:
        for direction in (Direction.LOAD, Direction.SAVE):
            for name in names:
                row = suite.measure(Case(model, tpb, granularity, direction, name, parse_size(args.batch_bytes)))
                print(json.dumps(row.as_dict()), flush=True)


def gather_sweep(batch_bytes: int, repeats: int) -> None:
    """GPU-to-GPU gathers of 16 KB and 512 KB pages: block shape, loads in flight, cache hints."""
    from kvtool.transfer.kernel_backend import KernelBackend
    suite = TransferSuite(torch.device("cuda"), repeats)
    names = []
    for threads, per_sm, unroll, load, store in GATHER_VARIANTS:
        name = f"kernel-t{threads}-b{per_sm}-u{unroll}-l{load}-s{store}"
        names.append(name)
        suite.register(name, lambda t=threads, b=per_sm, u=unroll, hint=load, s=store: KernelBackend(
            unroll=u, load_hint=hint, store_hint=s, device_threads=t, device_blocks_per_sm=b))
    for model, tpb, granularity in (("llama-3.1-8b", 4, "layer"), ("llama-3.1-8b", 4, "slot")):
        for name in names:
            row = suite.measure(Case(model, tpb, granularity, Direction.GATHER, name, batch_bytes))
            print(json.dumps(row.as_dict()), flush=True)


if __name__ == "__main__":
    main()
