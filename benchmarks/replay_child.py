"""One timed block-fidelity replay, prefill only, in a process of its own: one JSON line on stdout
with its wall and CPU seconds, tokens/s, µs per block, peak resident memory and the counts it decided.

    python -m benchmarks.replay_child TRACE TOKENS_PER_BLOCK NUM_SLOTS CONNECTOR [CAPACITY]

`replay_against` runs it under the source tree being measured (its PYTHONPATH), so it uses only
what kvtool offered before this file existed (`build_replay`, `run_trace`, `TraceSummary`): the
same file measures the current tree and an older commit's (whose modules had other paths).
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

COUNTS = ("num_requests", "prompt_tokens", "computed_tokens", "local_hit_tokens", "connector_hit_tokens",
          "cancelled_tokens", "saved_blocks", "loaded_blocks", "evictions", "connector_evictions", "iterations",
          "deferrals", "hit_rate", "simulated_seconds", "integrity_errors", "invariant_errors")
"""The summary fields two trees must agree on exactly."""


def replay(trace: Path, tokens_per_block: int, num_slots: int, connector: str, capacity: str | None) -> dict:
    """Replay `trace` and describe it (the peak RSS is this process's: run one replay a process)."""
    import torch

    import kvtool
    try:
        from kvtool.trace.replay import run_trace
        from kvtool.trace.setup import ReplayOptions, build_replay
    except ModuleNotFoundError:   # a tree from before the trace package (2e09364 and older)
        from kvtool.cli.trace_setup import ReplayOptions, build_replay  # type: ignore[no-redef]
        from kvtool.engine.trace import run_trace  # type: ignore[no-redef]

    torch.set_num_threads(1)   # the target is one core
    options = ReplayOptions(trace, prefill_only=True, fidelity="blocks", tokens_per_block=tokens_per_block,
                            num_slots=num_slots, connector=connector,
                            connector_opt=(f"capacity={capacity}",) if capacity else ())
    built = build_replay(options)
    cpu_before, started = _cpu_seconds(), time.perf_counter()
    result = run_trace(built.workload.requests(), built.config, built.connector, built.options,
                       keep_iterations=False)
    seconds, cpu = time.perf_counter() - started, _cpu_seconds() - cpu_before
    summary = result.summary.as_dict()
    blocks = summary["prompt_tokens"] / tokens_per_block
    return {"seconds": round(seconds, 3), "cpu_seconds": round(cpu, 3),
            "tokens_per_second": round(summary["prompt_tokens"] / seconds),
            "us_per_block": round(1e6 * seconds / blocks, 3),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "kvtool": str(Path(kvtool.__file__).parent),
            "counts": {key: summary[key] for key in COUNTS}}


def _cpu_seconds() -> float:
    """This process's CPU time, user and system: what a replay cost, whatever else shared the core."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str]) -> int:
    trace, tokens_per_block, num_slots, connector, *capacity = argv
    print(json.dumps(replay(Path(trace), int(tokens_per_block), int(num_slots), connector,
                            capacity[0] if capacity else None)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
