"""Replay speed of this tree against another (an older commit's checkout), measured in the same run:
the first 1 %, 10 % and 100 % of a trace, prefill only, blocks fidelity, each replay in a process
of its own (`replay_child`, run under each tree's PYTHONPATH), the two trees alternating.

    python -m benchmarks.replay_versus TRACE --baseline DIR [--fractions 0.01,0.1,1]
        [--tokens-per-block 32] [--num-slots 4000000] [--connector none] [--capacity C]
        [--core N] [--no-cli] [--output DIR]

A row per (fraction, tree): wall and CPU seconds, tokens/s, µs per block, peak RSS, and whether its
counts are the baseline's (they must be: exit 1 when any differs). CPU seconds (user and system)
are what the replay cost itself, which a busy machine's other work on the same core does not add to. Each
tree also replays the same slice the
way a user does, `python -m kvtool trace run SLICE --prefill-only --fidelity blocks ...` (imports,
the size check, the progress bar, the report and all): its wall and CPU seconds and peak RSS are
the row's `cli_seconds`, `cli_cpu_seconds` and `cli_peak_rss_mb` (`--no-cli` skips it). `--core` pins every
replay to that core
(taskset), and the load average is sampled each second through the run and recorded, so a row
measured on a shared machine says how shared it was. With --output: results.csv, results.json
and meta.json (machine, both commits, command, load).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pandas as pd

from benchmarks.replay_speed import head_of
from kvtool.report.run_folder import (
    git_commit,
    prepare_run_folder,
    settled_run_folders,
    write_file,
    write_json,
    write_meta,
)

THIS_TREE = Path(__file__).resolve().parents[1]
CHILD = Path(__file__).resolve().with_name("replay_child.py")
_RUN_CHILD = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
"""Runs replay_child.py by path without putting its folder on sys.path (kvtool/cli/trace.py would
shadow the standard library's `trace`), so an older tree that lacks the file runs it too. `-P` and
a neutral working directory keep the current one off sys.path: PYTHONPATH alone picks the tree."""


class LoadSampler:
    """The 1-minute load average, sampled every second on a thread while the run goes on."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.samples.append(os.getloadavg()[0])
            self._stop.wait(1.0)

    def summary(self) -> dict[str, float | int]:
        s = self.samples or [os.getloadavg()[0]]
        return {"load1_min": min(s), "load1_mean": round(sum(s) / len(s), 2), "load1_max": max(s),
                "samples": len(s), "cores": os.cpu_count() or 0}


def cpu_model() -> str | None:
    """This machine's CPU as the kernel names it (`model name` in /proc/cpuinfo), if it says."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)


def replay_under(tree: Path, head: Path, args: argparse.Namespace) -> dict:
    """One replay of `head` by the kvtool of `tree`, in a fresh process: replay_child's row."""
    command = [sys.executable, "-P", "-c", _RUN_CHILD, str(CHILD), str(head), str(args.tokens_per_block),
               str(args.num_slots), args.connector, *([args.capacity] if args.capacity else [])]
    if args.core is not None and shutil.which("taskset"):
        command = ["taskset", "-c", str(args.core), *command]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=head.parent)
    if done.returncode != 0:
        raise SystemExit(f"replay under {tree} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    if Path(row.get("kvtool", tree / "kvtool")).resolve() != (tree / "kvtool").resolve():
        raise SystemExit(f"the replay meant for {tree} ran {row['kvtool']}")
    return row


def cli_under(tree: Path, head: Path, args: argparse.Namespace) -> dict:
    """`kvtool trace run` of `head` by the kvtool of `tree`, as a user runs it: its wall seconds and
    peak RSS (of that process alone: `wait4`'s usage)."""
    command = [sys.executable, "-P", "-m", "kvtool", "trace", "run", str(head), "--prefill-only", "--fidelity",
               "blocks", "--tokens-per-block", str(args.tokens_per_block), "--num-slots", str(args.num_slots),
               "--connector", args.connector,
               *(["--connector-opt", f"capacity={args.capacity}"] if args.capacity else [])]
    if args.core is not None and shutil.which("taskset"):
        command = ["taskset", "-c", str(args.core), *command]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with tempfile.TemporaryFile() as output:
        started = time.perf_counter()
        process = subprocess.Popen(command, env=env, stdout=output, stderr=output, cwd=head.parent)
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - started
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode != 0:
            output.seek(0)
            raise SystemExit(f"trace run under {tree} failed (exit {process.returncode}):\n"
                             f"{output.read().decode(errors='replace')[-2000:]}")
    return {"cli_seconds": round(seconds, 3), "cli_cpu_seconds": round(usage.ru_utime + usage.ru_stime, 3),
            "cli_peak_rss_mb": round(usage.ru_maxrss / 1024, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--baseline", type=Path, required=True, help="a checkout of the code to compare against")
    parser.add_argument("--fractions", default="0.01,0.1,1")
    parser.add_argument("--tokens-per-block", type=int, default=32)
    parser.add_argument("--num-slots", type=int, default=4_000_000)
    parser.add_argument("--connector", default="none", help="none or index")
    parser.add_argument("--capacity", help="tokens of the index tier")
    parser.add_argument("--core", type=int, help="pin every replay to this core")
    parser.add_argument("--no-cli", action="store_true", help="skip the `kvtool trace run` timing")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    if not (args.baseline / "kvtool").is_dir():
        parser.error(f"--baseline {args.baseline}: no kvtool package there")
    folder = prepare_run_folder(args.output, "trace") if args.output else None
    trees = {"this": THIS_TREE, "baseline": args.baseline.resolve()}
    rows = []
    with tempfile.TemporaryDirectory() as scratch, LoadSampler() as load:
        for fraction in sorted(float(f) for f in args.fractions.split(",")):
            head, count = head_of(args.trace, fraction, Path(scratch))
            measured = {name: replay_under(tree, head, args) for name, tree in trees.items()}
            if not args.no_cli:
                for name, tree in trees.items():
                    measured[name].update(cli_under(tree, head, args))
            for name, row in measured.items():
                rows.append({"fraction": fraction, "requests": count, "tree": name,
                             "commit": git_commit(trees[name]), "seconds": row["seconds"],
                             "cpu_seconds": row["cpu_seconds"],
                             "tokens_per_second": row["tokens_per_second"], "us_per_block": row["us_per_block"],
                             "peak_rss_mb": row["peak_rss_mb"], "cli_seconds": row.get("cli_seconds"),
                             "cli_cpu_seconds": row.get("cli_cpu_seconds"),
                             "cli_peak_rss_mb": row.get("cli_peak_rss_mb"),
                             "hit_rate": row["counts"]["hit_rate"],
                             "counts_match": row["counts"] == measured["baseline"]["counts"],
                             "speedup": round(measured["baseline"]["seconds"] / row["seconds"], 3)})
                print(json.dumps(rows[-1]), flush=True)
    if folder is not None:
        write_json(folder / "results.json", {"rows": rows})
        write_file(folder / "results.csv", pd.DataFrame(rows).to_csv(index=False))
        write_meta(folder, "replay-versus", trace=str(args.trace), baseline=str(args.baseline),
                   baseline_commit=git_commit(trees["baseline"]), pinned_core=args.core,
                   cpu_model=cpu_model(), load_average=load.summary())
    print(json.dumps({"load_average": load.summary()}), flush=True)
    return 0 if all(r["counts_match"] for r in rows) else 1


if __name__ == "__main__":
    with settled_run_folders():
        sys.exit(main())
