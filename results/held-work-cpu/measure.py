"""The CPU measurements of results/held-work-cpu (issue 53): false alarms of correct connectors at
the default seed and with --explore 8, the asynchronous-to-synchronous time ratio (side by side,
interleaved), and the holds-forever connector's whole-kit time. Run from the repository root:
`python results/held-work-cpu/measure.py OUT_DIR DEADLINE_UNIX_SECONDS`; one JSON line per run
in OUT_DIR/runs.jsonl."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

CORRECT = {
    "host": "host",
    "host-async": "host-async",
    "example": "examples/dict_connector.py:DictConnectorScheduler:DictConnectorWorker",
    "slow-async": "tests/helpers/late_connectors.py:SlowPoolAsync:SlowPoolAsyncWorker",
    "thread-wait": "tests/helpers/late_connectors.py:BlocksInGetFinished:ThreadWaitWorker",
}
HOLDS_FOREVER = "tests.helpers.broken_connectors:AsyncScheduler:NeverReportsSaveWorker"
LATE_READER = "tests/helpers/late_connectors.py:LateReader:LateReaderWorker"


def run(out: Path, label: str, target: str, *args: str) -> dict:
    started, cpu = time.perf_counter(), _children_cpu()
    done = subprocess.run([sys.executable, "-m", "kvtool", "validate", target, *args],
                          capture_output=True, text=True)
    seconds, cpu = time.perf_counter() - started, _children_cpu() - cpu
    summary = next((line for line in reversed(done.stderr.splitlines() + done.stdout.splitlines())
                    if "checks:" in line), "")
    row = {"label": label, "target": target, "args": list(args), "rc": done.returncode,
           "seconds": round(seconds, 2), "cpu_seconds": round(cpu, 2),
           "load_average": round(os.getloadavg()[0], 2), "summary": summary.strip()}
    with open(out / "runs.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    return row


def _children_cpu() -> float:
    """User and system CPU seconds of every ended child (the validate run and its scenario processes)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    out, deadline = Path(sys.argv[1]), float(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        run(out, "holds-forever", HOLDS_FOREVER)
    run(out, "late-reader", LATE_READER)
    for _ in range(3):                                   # the ratio: side by side, interleaved
        for label in ("host", "host-async", "slow-async"):
            run(out, f"ratio:{label}", CORRECT[label])
    for i in range(20):                                  # false alarms at the default seed
        for label, target in CORRECT.items():
            if time.time() > deadline:
                return
            run(out, f"default:{label}", target)
    for i in range(20):                                  # false alarms with --explore 8
        for label, target in CORRECT.items():
            if time.time() > deadline:
                return
            run(out, f"explore8:{label}", target, "--explore", "8")


if __name__ == "__main__":
    main()
