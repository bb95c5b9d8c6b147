"""How fast a block-fidelity replay runs, and whether its cost per block stays flat as the trace
grows: the first 1 %, 10 % and 100 % of a trace, prefill only, one connector-tier capacity, one
core; and the shipped workload in bytes fidelity (the path `validate` uses).

    python -m benchmarks.replay_speed TRACE [--fractions 0.01,0.1,1] [--repeats N] [--output DIR] [--profile]

Prints one JSON row per replay (tokens/s, µs per block) and, with --output, writes
results.json, results.csv, meta.json and (--profile) the top of a cProfile of the largest run.

Whether the cost per block stays flat is also measured inside one replay, free of the machine's
minute-to-minute drift between runs: the largest replay of the first round is cut into
`--segments` parts of equal prompt tokens (in the order requests finish), and each part's
seconds per prompt block is reported with its hit rate (hit blocks cost less than computed ones,
so a part's mix of the two moves its cost). Written to segments.csv.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

from kvtool.engine.events import Finished
from kvtool.report.run_folder import prepare_run_folder, settled_run_folders, write_file, write_json, write_meta
from kvtool.trace.replay import run_trace
from kvtool.trace.setup import ReplayOptions, build_replay

SHIPPED = Path(__file__).resolve().parents[1] / "workloads" / "shared_prefix.jsonl"


class SegmentClock:
    """Subscriber and per-iteration hook: the clock and the finished prompt and hit tokens after
    every iteration, cut afterwards into parts of equal prompt tokens."""

    event_kinds = frozenset({Finished})

    def __init__(self) -> None:
        self.prompt_tokens = self.hit_tokens = 0
        self.marks: list[tuple[float, int, int]] = [(time.perf_counter(), 0, 0)]

    def __call__(self, event) -> None:
        if isinstance(event, Finished):
            self.prompt_tokens += event.prompt_len
            self.hit_tokens += event.num_local_hit + event.num_external

    def after_iteration(self, _engine) -> None:
        self.marks.append((time.perf_counter(), self.prompt_tokens, self.hit_tokens))

    def segments(self, count: int, tokens_per_block: int) -> list[dict]:
        """Per part: its share of the prompt tokens, µs per prompt block, hit rate."""
        total = self.marks[-1][1]
        rows, start = [], self.marks[0]
        for k in range(1, count + 1):
            end = next(m for m in self.marks if m[1] >= total * k / count)
            tokens = end[1] - start[1]
            if tokens:
                rows.append({"segment": k, "prompt_tokens": tokens,
                             "us_per_block": round(1e6 * (end[0] - start[0]) / (tokens / tokens_per_block), 3),
                             "hit_rate": round((end[2] - start[2]) / tokens, 6)})
            start = end
        return rows


def replay_row(label: str, options: ReplayOptions, profile: bool = False,
               clock: SegmentClock | None = None) -> tuple[dict, str]:
    """One timed replay of `options.workload`: its row, and the cProfile top (when asked).
    `clock`, when given, is fed every finished request and iteration."""
    replay = build_replay(options)
    profiler = cProfile.Profile() if profile else None
    started = time.perf_counter()
    if profiler:
        profiler.enable()
    result = run_trace(replay.workload.requests(), replay.config, replay.connector, replay.options,
                       keep_iterations=False, subscribers=[clock] if clock else (),
                       on_iteration=clock.after_iteration if clock else None)
    if profiler:
        profiler.disable()
    seconds = time.perf_counter() - started
    s = result.summary
    blocks = s.prompt_tokens / s.tokens_per_block
    row = {"run": label, "fidelity": s.fidelity, "requests": s.num_requests, "prompt_tokens": s.prompt_tokens,
           "tokens_per_block": s.tokens_per_block, "seconds": round(seconds, 3),
           "tokens_per_second": round(s.prompt_tokens / seconds), "us_per_block": round(1e6 * seconds / blocks, 3),
           "hit_rate": s.hit_rate, "iterations": s.iterations, "failed_checks": "; ".join(result.failed_checks)}
    top = ""
    if profiler:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        top = text.getvalue()
    return row, top


def head_of(trace: Path, fraction: float, folder: Path) -> tuple[Path, int]:
    """The first `fraction` of the trace's lines in a file of their own, and how many."""
    with trace.open() as handle:
        total = sum(1 for line in handle if line.strip())
    count = max(1, round(total * fraction))
    if count >= total:
        return trace, total
    path = folder / f"head-{count}.jsonl"
    with trace.open() as source, path.open("w") as target:
        target.writelines(itertools.islice((line for line in source if line.strip()), count))
    return path, count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, help="a Mooncake or Bailian trace (or kvtool JSON Lines)")
    parser.add_argument("--fractions", default="0.01,0.1,1", help="leading fractions of the trace to replay")
    parser.add_argument("--tokens-per-block", type=int, default=32)
    parser.add_argument("--capacity", default="1e8", help="tokens of the index tier")
    parser.add_argument("--output", type=Path, help="run folder for results.json/csv and meta.json")
    parser.add_argument("--profile", action="store_true", help="cProfile the largest replay")
    parser.add_argument("--segments", type=int, default=10,
                        help="parts of the largest replay (first round) whose cost per block is compared")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds over the fractions, interleaved (a slow minute of the machine hits every "
                             "fraction alike); the medians are reported")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)   # the target is one core
    folder = prepare_run_folder(args.output, "trace") if args.output else None
    fractions = sorted(float(f) for f in args.fractions.split(","))
    if args.repeats < 1 or args.segments < 1:
        parser.error("--repeats and --segments must be at least 1")
    rows, profile_text, segments = [], "", []
    with tempfile.TemporaryDirectory() as scratch:
        heads = [head_of(args.trace, fraction, Path(scratch)) for fraction in fractions]
        for repeat in range(args.repeats):
            for fraction, (path, count) in zip(fractions, heads, strict=True):
                options = ReplayOptions(path, prefill_only=True, fidelity="blocks",
                                        tokens_per_block=args.tokens_per_block, connector="index",
                                        connector_opt=(f"capacity={args.capacity}",))
                largest_first = repeat == 0 and fraction == fractions[-1]
                clock = SegmentClock() if largest_first and not args.profile else None
                row, top = replay_row(f"{fraction:g} of the trace ({count} requests)", options,
                                      args.profile and largest_first, clock)
                rows.append({**row, "repeat": repeat})
                profile_text = top or profile_text
                print(json.dumps(rows[-1]), flush=True)
                if clock is not None:
                    segments = clock.segments(args.segments, args.tokens_per_block)
                    for segment in segments:
                        print(json.dumps({"segment": segment}), flush=True)
    shipped, _ = replay_row("shipped workload, bytes fidelity, host connector",
                            ReplayOptions(SHIPPED, connector="host", no_local_reuse=True))
    rows.append(shipped)
    print(json.dumps(shipped), flush=True)
    medians = _medians(rows)
    for row in medians:
        print(json.dumps({"median": row}), flush=True)
    if folder is not None:
        write_json(folder / "results.json", {"rows": rows, "medians": medians, "segments": segments})
        write_file(folder / "results.csv", pd.DataFrame(rows).to_csv(index=False))
        if segments:
            write_file(folder / "segments.csv", pd.DataFrame(segments).to_csv(index=False))
        if profile_text:
            write_file(folder / "profile.txt", profile_text)
        write_meta(folder, "trace-replay-bench", trace=str(args.trace), capacity_tokens=args.capacity,
                   threads=1)
    return 1 if any(r["failed_checks"] for r in rows) else 0


def _medians(rows: list[dict]) -> list[dict]:
    """Per run label: the median seconds, tokens/s and µs per block over the repeats."""
    frame = pd.DataFrame([r for r in rows if "repeat" in r])
    if frame.empty:
        return []
    grouped = frame.groupby("run", sort=False)[["seconds", "tokens_per_second", "us_per_block"]].median()
    return [{"run": run, **{k: round(float(v), 3) for k, v in values.items()}, "repeats": int((frame.run == run).sum())}
            for run, values in grouped.iterrows()]


if __name__ == "__main__":
    with settled_run_folders():
        sys.exit(main())
