"""The frames where a py-spy profile's scenario processes spent their samples.

`py-spy record --subprocesses --format raw` writes one line per stack (`frame;frame;... COUNT`).
This keeps the stacks of validate's scenario processes (children of a fork server: a
`_serve_one` frame), and prints the innermost frames with the most samples, with their share.

    python3 benchmarks/folded_top.py results/h100-gpu-kit-study/run-b-ca79431/kit.folded.gz [--top 12]
"""

from __future__ import annotations

import argparse
import collections
import gzip


def innermost_frames(path: str) -> tuple[int, collections.Counter]:
    """(samples in scenario processes, samples by innermost frame)."""
    total, frames = 0, collections.Counter()
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as lines:
        for line in lines:
            if " " not in line.strip():
                continue
            stack, count = line.rstrip().rsplit(" ", 1)
            stack_frames = [f for f in stack.split(";") if not f.startswith("process ")]
            if any("_serve_one" in f for f in stack_frames):
                total += int(count)
                frames[stack_frames[-1]] += int(count)
    return total, frames


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folded")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    total, frames = innermost_frames(args.folded)
    print(f"{total} samples in scenario processes")
    for frame, count in frames.most_common(args.top):
        print(f"{count:6d} {count / total:6.1%}  {frame}")


if __name__ == "__main__":
    main()
