"""Kernel tuning sweep: SMs used and loads in flight per lane, against the same run's peak.

    python -m kvtool.bench.tune [--batch-bytes 64MiB] [--repeats 10]

Prints one row per (variant, direction, chunk size); the defaults of the `kernel` backend come from
this sweep on the target GPU.
"""

from __future__ import annotations

import argparse
import json

import torch

from kvtool.bench.transfer_suite import Case, TransferSuite
from kvtool.units import parse_size

VARIANTS = [(sms, unroll, hint, 1024) for sms in (2, 4, 8, 16) for unroll in (4, 8) for hint in (0, 1)]
SHAPES = [("llama-3.1-8b", 4, "layer"), ("llama-3.1-8b", 16, "layer"), ("llama-3.1-8b", 4, "slot")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-bytes", default="64MiB")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    from kvtool.transfer.kernel_backend import KernelBackend
    suite = TransferSuite(torch.device("cuda"), args.repeats)
    names = []
    for sms, unroll, hint, threads in VARIANTS:
        name = f"kernel-{sms}sm-u{unroll}-h{hint}-t{threads}"
        names.append(name)
        suite.register(name, lambda s=sms, u=unroll, h=hint, t=threads: KernelBackend(
            max_sms=s, unroll=u, load_hint=h, host_threads=t))
    for model, tpb, granularity in SHAPES:
        for direction in ("load", "save"):
            for name in names:
                row = suite.measure(Case(model, tpb, granularity, direction, name, parse_size(args.batch_bytes)))
                print(json.dumps(row.as_dict()), flush=True)


if __name__ == "__main__":
    main()
