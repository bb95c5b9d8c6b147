"""`kvtool trace run --instances N`: one workload over N engine instances, each in its own process
with its own GPU pool and connector, requests routed to them, and the per-instance and global hit
rates. With a shared store (`redis`, `redis-index`) the instances hit each other's prefixes; with
an in-process tier (`host`, `index`) each has its own: the local-versus-global comparison.

Routing (`--route`):
- `round-robin`: request i goes to instance i mod N.
- `prefix`: a cache-aware router. It remembers, per 512-token prefix, the instance it last sent that
  prefix to; a request goes to the instance holding its longest remembered prefix when that covers
  at least half of its prompt, else to the instance with the fewest prompt tokens so far.

The instances' simulated clocks advance in lockstep: none runs more than `--sync-window` simulated
seconds ahead of another still running, so what one saves at time t is in the store before another
passes t + window (whatever the real speed of each process).
"""

from __future__ import annotations

import multiprocessing
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtool.connector.request import Request
from kvtool.errors import InputError
from kvtool.manager.block_keys import ReuseScope, chained_block_keys
from kvtool.trace.recorder import RequestRow
from kvtool.trace.replay import run_trace, token_hit_rate
from kvtool.trace.setup import ReplayOptions, build_replay
from kvtool.types import TextEnum

ROUTE_BLOCK_TOKENS = 512
DEFAULT_SYNC_WINDOW_S = 1.0


class Route(TextEnum):
    ROUND_ROBIN = "round-robin"
    PREFIX = "prefix"


@dataclass(frozen=True)
class InstancesPlan:
    options: ReplayOptions
    num_instances: int
    route: Route
    sync_window_s: float


def assign_requests(requests, num_instances: int, route: Route) -> bytes:
    """The instance of each request, in workload order (one byte each)."""
    if route is Route.ROUND_ROBIN:
        return bytes(i % num_instances for i, _ in enumerate(requests))
    router = _PrefixRouter(num_instances)
    return bytes(router.route(r) for r in requests)


class _PrefixRouter:
    def __init__(self, num_instances: int) -> None:
        self.owner: dict[bytes, int] = {}
        self.load = [0] * num_instances

    def route(self, request: Request) -> int:
        tokens = request.get_tokens(0)[:request.prompt_len]
        keys = [key for _, key in chained_block_keys(tokens, ROUTE_BLOCK_TOKENS,
                                                     ReuseScope.from_cache_salt(request.cache_salt))]
        matched = 0
        while matched < len(keys) and keys[matched] in self.owner:
            matched += 1
        if matched and 2 * matched * ROUTE_BLOCK_TOKENS >= len(tokens):
            chosen = self.owner[keys[matched - 1]]
        else:
            chosen = min(range(len(self.load)), key=self.load.__getitem__)
        for key in keys:
            self.owner[key] = chosen
        self.load[chosen] += len(tokens)
        return chosen


def run_instances(plan: InstancesPlan, on_progress: Callable[[int], None]) -> list[dict[str, Any]]:
    """Every instance's summary (a dict, with `instance`); InputError naming the instance that
    broke. `on_progress` gets the number of instances finished."""
    replay = build_replay(plan.options)
    if replay.config.num_ranks != 1:
        raise InputError("--instances runs one rank per instance: drop --num-ranks")
    assignment = assign_requests(replay.workload.requests(), plan.num_instances, plan.route)
    context = multiprocessing.get_context("spawn")
    clocks = context.Array("d", plan.num_instances, lock=False)
    done = context.Array("b", plan.num_instances, lock=False)
    results = context.Queue()
    processes = [context.Process(target=_instance_main, daemon=True,
                                 args=(plan, k, assignment, clocks, done, results)) for k in range(plan.num_instances)]
    for p in processes:
        p.start()
    rows: list[dict[str, Any]] = []
    try:
        while len(rows) < plan.num_instances:
            kind, k, payload = _next_report(results, processes, {row["instance"] for row in rows})
            if kind == "error":
                raise InputError(f"instance {k}: {payload}")
            rows.append(payload)
            on_progress(len(rows))
    finally:
        for p in processes:
            if p.is_alive():
                p.terminate()
            p.join()
    return with_load_ratios(sorted(rows, key=lambda row: row["instance"]))


def _next_report(results, processes, reported: set[int]) -> tuple[str, int, Any]:
    """The next report; an error for an instance whose process died without one (it could not even
    start, or was killed)."""
    while True:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            for k, p in enumerate(processes):
                if k not in reported and p.exitcode is not None:
                    try:
                        return results.get(timeout=1.0)    # it reported just before exiting
                    except queue.Empty:
                        return "error", k, f"its process exited with code {p.exitcode} without a report"


def _instance_main(plan: InstancesPlan, k: int, assignment: bytes, clocks, done, results) -> None:
    try:
        replay = build_replay(plan.options)
        mine = (r for i, r in enumerate(replay.workload.requests()) if assignment[i] == k)
        lockstep = _lockstep(k, clocks, done, plan.sync_window_s)
        try:
            result = run_trace(mine, replay.config, replay.connector, replay.options, on_iteration=lockstep,
                               keep_iterations=False)
        finally:
            done[k] = 1
        row = {"instance": k, **result.summary.as_dict(), "failed_checks": "; ".join(result.failed_checks),
               **latency_columns(result.recorder.requests if replay.cost_model else [])}
        row[LATENCIES] = _latencies(result.recorder.requests) if replay.cost_model else ([], [])
        results.put(("row", k, row))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which exits with it
        done[k] = 1
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        results.put(("error", k, f"{type(exc).__name__}: {exc} ({frame.filename}:{frame.lineno})"))


def _lockstep(k: int, clocks, done, window_s: float) -> Callable:
    """An on_iteration hook: publish this instance's clock, and wait while another instance that is
    still running lags more than `window_s` behind it."""
    others = [j for j in range(len(clocks)) if j != k]

    def wait_for_the_others(engine) -> None:
        clocks[k] = engine.clock
        while any(not done[j] and clocks[j] < engine.clock - window_s for j in others):
            time.sleep(0.0005)
    return wait_for_the_others


LATENCIES = "_latencies"
"""A row's (TTFT values, TPOT values) from its process, for the fleet's percentiles (not written)."""
PERCENTILES = {"ttft": (50, 90, 99), "tpot": (50, 99)}


def _latencies(requests: list[RequestRow]) -> tuple[list[float], list[float]]:
    return ([r.ttft for r in requests if r.ttft is not None], [r.tpot for r in requests if r.tpot is not None])


def latency_columns(requests: list[RequestRow]) -> dict[str, float | None]:
    """`ttft_p50_s` ... `tpot_p99_s` over `requests` (None without any: no cost model)."""
    return _percentile_columns(*_latencies(requests))


def _percentile_columns(ttft: list[float], tpot: list[float]) -> dict[str, float | None]:
    columns: dict[str, float | None] = {}
    for metric, values in (("ttft", ttft), ("tpot", tpot)):
        for p in PERCENTILES[metric]:
            columns[f"{metric}_p{p}_s"] = float(np.percentile(values, p)) if values else None
    return columns


def with_load_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each instance's prefill work (prompt tokens it computed: neither hit locally nor loaded) over
    the fleet's mean, as `load_ratio` (1.0: its fair share)."""
    work = [r["prompt_tokens"] - r["local_hit_tokens"] - r["connector_hit_tokens"] for r in rows]
    mean = sum(work) / len(work) if work else 0
    return [{**r, "load_ratio": round(w / mean, 4) if mean else None} for r, w in zip(rows, work, strict=True)]


def fleet_rows(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """`run_instances`' rows as written (without the latencies they carried) and the `all` row."""
    return [{k: v for k, v in r.items() if k != LATENCIES} for r in rows], global_row(rows)


def global_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The instances together: sums, the hit rate over every prompt token, TTFT and TPOT
    percentiles over every request, and `load_imbalance`: the busiest instance's `load_ratio`."""
    summed = ("num_requests", "prompt_tokens", "computed_tokens", "local_hit_tokens", "connector_hit_tokens",
              "cancelled_tokens", "integrity_errors", "failed_requests", "iterations", "evictions")
    total = {name: sum(r[name] for r in rows) for name in summed}
    total["hit_rate"] = token_hit_rate(total["local_hit_tokens"], total["connector_hit_tokens"],
                                       total["prompt_tokens"])
    total["wall_seconds"] = max(r["wall_seconds"] for r in rows)
    total["failed_checks"] = "; ".join(f"instance {r['instance']}: {r['failed_checks']}"
                                       for r in rows if r["failed_checks"])
    ttft = [v for r in rows for v in r.get(LATENCIES, ([], []))[0]]
    tpot = [v for r in rows for v in r.get(LATENCIES, ([], []))[1]]
    ratios = [r["load_ratio"] for r in rows if r.get("load_ratio") is not None]
    return {"instance": "all", **total, **_percentile_columns(ttft, tpot),
            "load_imbalance": max(ratios) if ratios else None}
