"""`kvtool trace sweep`: one replay per (connector-tier capacity, tokens per block), in parallel
processes, into one table, `sweep.csv`/`sweep.json` and the hit-rate plots.

The tier is the built-in one of the fidelity: `index` (capacity in tokens) for blocks, `host`
(capacity in bytes: capacity // tokens_per_block whole blocks) for bytes, so both fidelities sweep
the same number of blocks at each point. `--connector` names another: one of the tiers kvtool can
size (`SIZED_TIERS`) is swept over capacity the same way; any other connector (one of your own,
`disk`, a remote store) keeps the size its own options give it, and the sweep runs one point per
tokens per block (`capacity_tokens` empty). A connector with a `dir` option left to its default
gets a fresh temporary folder per point, so that no point is served what another one saved.
"""

from __future__ import annotations

import json
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import replace
from multiprocessing import get_context
from pathlib import Path
from typing import Annotated, Any

import pandas as pd
import torch
import typer
from rich.console import Console

from kvtool.cli.common import (
    CONNECTOR_CHOICES,
    FORMAT_HELP,
    OUTPUT_HELP,
    ExitCode,
    OutputFormat,
    clean_errors,
    fail,
    frame_text,
    print_connector_help,
    progress_bar,
    say,
    warn,
)
from kvtool.cli.trace_options import ConnectorHelp, with_replay_options
from kvtool.connector.options import declared_options
from kvtool.connectors.registry import load_connector
from kvtool.errors import InputError, OutOfMemoryError
from kvtool.manager.storage import host_memory_bytes, memory_shortfall
from kvtool.report.run_folder import prepare_run_folder
from kvtool.report.sweep_report import sweep_tables, write_sweep_folder
from kvtool.trace.load_check import load_check
from kvtool.trace.replay import run_trace
from kvtool.trace.report import ttft_stats
from kvtool.trace.setup import (
    Replay,
    ReplayOptions,
    block_bytes,
    build_replay,
    check_cache_holds,
    check_pools_fit_memory,
    workload_sizes,
)
from kvtool.trace.study import slo_attainment, study_caption, sweep_meta, sweep_study, with_cost
from kvtool.trace.sweep_points import SweepPoint, sweep_points
from kvtool.trace.tier_size import pool_tokens, tier_tokens
from kvtool.types import Fidelity
from kvtool.units import Capacity, format_gib, parse_capacity, parse_size
from kvtool.workloads.prepared import PreparedWorkload, prepare_workload

DEFAULT_CAPACITIES = "1e4,1e5,1e6,1e7,1e8,1e9"
SIZED_TIERS = {"index": "tokens", "host": "bytes", "host-async": "bytes", "host-layerwise": "bytes",
               "host-reserve": "bytes"}
"""The connectors whose `capacity` the sweep sets at each point, and its unit there."""


@clean_errors
@with_replay_options
def trace_sweep(
    options: ReplayOptions,
    connector: Annotated[str | None, typer.Option(metavar="NAME", help=f"The tier: {CONNECTOR_CHOICES}. "
                         f"{', '.join(SIZED_TIERS)} are swept over --capacity; any other connector keeps the size "
                         "its --connector-opt give it, and only --tokens-per-block is swept [default: index for "
                         "--fidelity blocks, host for bytes].")] = None,
    connector_help: ConnectorHelp = False,
    capacity: Annotated[str | None, typer.Option(metavar="SIZE|TOKENS,...", help="Capacities of the connector "
                                                    "tier a GPU, comma-separated: sizes (16GiB, 64GiB; SI units such "
                                                    "as 10GB are said in GiB) or tokens (1e6), whole blocks of the "
                                                    "model's shard [default: "
                                                    f"{DEFAULT_CAPACITIES} tokens].")] = None,
    tokens_per_block: Annotated[str, typer.Option(metavar="N,...", help="Tokens per block, comma-separated: "
                                                  "every capacity runs at each.")] = "32",
    jobs: Annotated[int | None, typer.Option(metavar="N", help="Replays at once, each in its own process "
                                                "[default: the cores there are].")] = None,
    tp: Annotated[int, typer.Option(metavar="N", help="Tensor-parallel GPUs an engine: the cost model divides "
                                    "compute and weights by N, the GPU pool and the tier are a GPU's (blocks "
                                    "fidelity replays rank 0's shard).")] = 1,
    baseline: Annotated[bool, typer.Option("--baseline", help="Also replay without the tier: the no-tier point "
                                           "(capacity 0) the knee's gain and TTFT are set against.")] = False,
    ttft_slo: Annotated[float | None, typer.Option(metavar="SECONDS", help="A TTFT objective: each point's "
                                                      "share of requests whose first token came within it (needs "
                                                      "the cost model).")] = None,
    price_per_gib: Annotated[float | None, typer.Option(metavar="PRICE", help="What a GiB of the tier costs "
                                                           "(any currency): each point's cost a GPU, and the "
                                                           "knee's.")] = None,
    format: Annotated[OutputFormat, typer.Option("--format", help=FORMAT_HELP)] = OutputFormat.table,
    output: Annotated[Path | None, typer.Option(metavar="DIR", help=OUTPUT_HELP.format(
        files="sweep.csv, sweep.json, capacity_study.png, hit_rate_vs_capacity.png, "
              "hit_rate_vs_tokens_per_block.png"))] = None,
) -> None:
    """Hit rate and TTFT against tier capacity and block size.

    One replay of WORKLOAD per (capacity, tokens per block), and with --baseline one without the
    tier, in parallel processes; the report ends with the knee (95 % of the plateau's gain) as a
    recommendation."""
    options = replace(options, tp=tp)
    if connector_help and connector is None and options.workload is None:
        raise InputError("--connector-help without --connector lists the sweep's own tier, which WORKLOAD's "
                         "fidelity chooses: give WORKLOAD or --connector")
    fidelity = build_replay(replace(options, connector="none", connector_opt=())).config.fidelity \
        if connector is None else None
    tier = connector or ("index" if fidelity == Fidelity.BLOCKS else "host")
    if connector_help:
        print_connector_help(load_connector(tier, options.compat))
        return
    sized = tier in SIZED_TIERS
    if not sized and capacity is not None:
        raise InputError(f"connector {tier!r} keeps its own size (kvtool sizes only {', '.join(SIZED_TIERS)}): "
                         "drop --capacity; the sweep runs --tokens-per-block only (its size: --connector-opt)")
    capacities = _capacities(capacity or DEFAULT_CAPACITIES) if sized else [None]
    tpbs = _positive_list(tokens_per_block, "--tokens-per-block", _whole_number)
    _check_study_options(jobs, ttft_slo, price_per_gib)
    if sized and any(pair.split("=", 1)[0] == "capacity" for pair in options.connector_opt):
        raise InputError("the sweep sets the tier's capacity itself: give --capacity, not --connector-opt capacity=")
    options = replace(options, connector=tier)
    fidelity = fidelity or build_replay(options).config.fidelity
    if ttft_slo is not None and build_replay(options).cost_model is None:
        raise InputError("--ttft-slo is judged on the cost model's TTFT, which this sweep has not (off by default for "
                         "kvtool workloads): add --cost-model")
    points = [replace(p, ttft_slo=ttft_slo) for p in sweep_points(options, fidelity, capacities, tpbs, baseline)]
    point_options = [point_replay_options(options, fidelity, p) for p in points]
    sizes = workload_sizes(build_replay(options).workload)
    notes: dict[str, None] = dict.fromkeys(c.si_note for c in capacities if c is not None and c.si_note)
    kept = []
    for point, each in zip(points, point_options, strict=True):
        replay = build_replay(each)   # every InputError now, before any replay
        check_pools_fit_memory(replay)
        check_cache_holds(replay, sizes)
        try:
            check_tier_fits_memory(point, each, points)
        except OutOfMemoryError:
            if capacity is not None:
                raise
            notes.setdefault(f"the default capacity {_tokens(point.capacity_tokens or 0)} is left out at "
                             f"{point.tokens_per_block} tokens per block: the {tier} tier would not fit this "
                             "machine's memory (--capacity chooses)")
            continue
        kept.append((point, each))
        notes.setdefault(replay.load_rate_note or "")
    if capacity is not None:       # the capacities asked for (a default grid reaches below any pool)
        notes.setdefault(_shadowed_note([(p, build_replay(o)) for p, o in kept]) or "")
    points, point_options = [p for p, _ in kept], [o for _, o in kept]
    folder = prepare_run_folder(output, "trace") if output is not None else None
    for note in filter(None, notes):   # one line per row --bandwidth-from took, whatever the points
        say(note)
    with tempfile.TemporaryDirectory(prefix="kvtool-sweep-workload-") as shared:
        prepared = prepare_workload(build_replay(options).workload, Path(shared)) if len(points) > 1 else None
        rows = _run_all(points, point_options, _jobs_that_fit(point_options, jobs or os.cpu_count() or 1),
                        Console(stderr=True), prepared)
    rows = [with_cost(row, price_per_gib) for row in rows]
    study = sweep_study(rows, price_per_gib, ttft_slo)
    _print_sweep(rows, study, format)
    overloaded = [_capacity_words(r) for r in rows if r.get("overloaded")]
    if overloaded:
        warn(f"the engine did not keep up with the arrivals at {', '.join(overloaded)}: TTFT there measures the "
             "queue more than the tier (trace run says by how much; add GPUs with --tp, or replay fewer requests)")
    if folder is not None:
        replay = build_replay(point_options[-1])
        write_sweep_folder(folder, pd.DataFrame(rows), {"workload": str(options.workload), "seed": options.seed,
                                                        "jobs": jobs or os.cpu_count(), **sweep_meta(replay)},
                           study, study_caption(replay, options, ttft_slo))
    failed = [f"capacity {r['capacity_tokens'] if r['capacity_tokens'] is not None else 'of its own'} at "
              f"{r['tokens_per_block']} tokens per block: {r['failed_checks']}" for r in rows if r["failed_checks"]]
    if failed:
        raise fail("; ".join(failed), ExitCode.CHECK_FAILED)


def _shadowed_note(points: list[tuple[SweepPoint, Replay]]) -> str | None:
    """One line naming the capacities no larger than the GPU pool (their tier holds what the GPU
    still holds: few tier hits), or None."""
    small = [(p, r) for p, r in points if p.capacity_tokens and r.config.scheduler.local_reuse
             and (tier_tokens(r) or 0) <= pool_tokens(r)]
    if not small:
        return None
    names = ", ".join(format_gib(p.capacity_bytes) if p.capacity_bytes else f"{p.capacity_tokens:,} tokens"
                      for p, _ in small)
    return (f"the tier at {names} holds no more than the GPU pool's {pool_tokens(small[0][1]):,} tokens: what it "
            "holds is still on the GPU, where a reuse counts as a local hit, so expect few or no tier hits there")


def _capacity_words(row: dict[str, Any]) -> str:
    if row["capacity_tokens"] == 0:
        return "no tier"
    return "its own size" if row.get("capacity_bytes") is None else format_gib(row["capacity_bytes"])


def _check_study_options(jobs: int | None, ttft_slo: float | None, price_per_gib: float | None) -> None:
    if jobs is not None and jobs <= 0:
        raise InputError(f"--jobs must be positive, got {jobs}")
    for name, value in (("--ttft-slo", ttft_slo), ("--price-per-gib", price_per_gib)):
        if value is not None and not (0 < value < float("inf")):
            raise InputError(f"{name} must be a positive number, got {value}")


def _capacities(text: str) -> list[Capacity]:
    """`--capacity`'s items, each tokens or a size; InputError naming the bad one."""
    values = []
    for item in text.split(","):
        try:
            values.append(parse_capacity(item.strip()))
        except ValueError as exc:
            raise InputError(f"--capacity: {exc}") from None
    return values


def _print_sweep(rows: list[dict[str, Any]], study: dict[str, Any], format: OutputFormat) -> None:
    frame = pd.DataFrame(rows)
    if format is OutputFormat.table:
        for table in sweep_tables(frame):
            Console().print(table)
        for tpb, part in study["tokens_per_block"].items():
            if part["recommendation"]:
                prefix = f"{tpb} tokens per block: " if len(study["tokens_per_block"]) > 1 else ""
                Console().print(prefix + part["recommendation"], highlight=False, markup=False)
    elif format is OutputFormat.json:
        print(json.dumps(rows, indent=2))
    else:
        print(frame_text(frame, format), end="")


def _positive_list(text: str, option: str, parse) -> list[int]:
    values = []
    for item in text.split(","):
        try:
            value = parse(item.strip())
        except ValueError as exc:
            raise InputError(f"{option}: {exc}") from None
        if value <= 0:
            raise InputError(f"{option} values must be positive, got {item.strip()}")
        values.append(value)
    return sorted(set(values))


def _whole_number(text: str) -> int:
    if not text.lstrip("-").isdigit():
        raise ValueError(f"not a whole number: {text!r}")
    return int(text)


def _tier_bytes(options: ReplayOptions) -> int:
    """The host-memory tier a point may fill whole (its `capacity=` in bytes); 0 for the others."""
    if SIZED_TIERS.get(options.connector) != "bytes":
        return 0
    return next((parse_size(o.partition("=")[2]) for o in options.connector_opt if o.startswith("capacity=")), 0)


def _jobs_that_fit(point_options: list[ReplayOptions], jobs: int) -> int:
    """`jobs`, lowered (and said) so that the largest host tiers running at once fit this machine's
    memory together."""
    largest = sorted((_tier_bytes(o) for o in point_options), reverse=True)
    memory = host_memory_bytes()
    fit = jobs
    while fit > 1 and sum(largest[:fit]) > memory:
        fit -= 1
    if fit < min(jobs, len(point_options)):
        say(f"{fit} replays at once instead of {jobs}: the host tiers of more would not fit this machine's memory "
            "together")
    return fit


def check_tier_fits_memory(point: SweepPoint, options: ReplayOptions, points: list[SweepPoint]) -> None:
    """OutOfMemoryError before any replay when a point's host-memory tier (which the replay may fill
    whole) is larger than this machine's memory, naming the capacities that fit."""
    size = _tier_bytes(options)
    if point.capacity_tokens is None or not size:
        return
    shortfall = memory_shortfall(size, torch.device("cpu"))
    if shortfall:
        fits = [p.capacity_tokens for p in points if p.capacity_tokens is not None
                and p.capacity_tokens < point.capacity_tokens]
        advice = f"--capacity up to {_tokens(max(fits))}" if fits else "a smaller --capacity"
        raise OutOfMemoryError(f"the {options.connector} tier at {_tokens(point.capacity_tokens)} tokens does not "
                               f"fit: {shortfall}: give {advice}, or sweep --fidelity blocks (the index tier, "
                               "no bytes)")


def _tokens(count: int) -> str:
    """1e8 for 100000000, 12345 as it is."""
    mantissa, _, exponent = f"{count:.0e}".partition("e")
    return f"{mantissa}e{int(exponent)}" if float(f"{count:.0e}") == count else str(count)


def point_replay_options(options: ReplayOptions, fidelity: Fidelity, point: SweepPoint) -> ReplayOptions:
    """The replay of one point: `options.connector` holding `point.capacity_tokens` tokens (in its
    own unit, `SIZED_TIERS`), or as its own options size it (capacity None)."""
    at_size = replace(options, tokens_per_block=point.tokens_per_block, fidelity=fidelity)
    if point.capacity_tokens == 0:
        return replace(at_size, connector="none", connector_opt=(), connector_dir=None)
    if point.capacity_tokens is None:
        return at_size
    if SIZED_TIERS[options.connector] == "tokens":
        size = point.capacity_tokens
    else:
        manager = build_replay(at_size).config.manager
        size = max(point.capacity_tokens // point.tokens_per_block, 1) * block_bytes(manager)
    return replace(at_size, connector_opt=options.connector_opt + (f"capacity={size}",))


def _run_all(points: list[SweepPoint], point_options: list[ReplayOptions], jobs: int,
             console: Console, prepared: PreparedWorkload | None) -> list[dict[str, Any]]:
    rows: list[dict[str, Any] | None] = [None] * len(points)
    with progress_bar("sweep", len(points), console) as update:
        if jobs == 1 or len(points) == 1:
            for i, (point, each) in enumerate(zip(points, point_options, strict=True)):
                rows[i] = run_point(point, each, prepared)
                update(advance=1)
        else:
            with ProcessPoolExecutor(min(jobs, len(points)), mp_context=get_context("spawn")) as pool:
                futures = {pool.submit(run_point, p, o, prepared): i
                           for i, (p, o) in enumerate(zip(points, point_options, strict=True))}
                for future in as_completed(futures):
                    rows[futures[future]] = future.result()
                    update(advance=1)
    return [row for row in rows if row is not None]


def run_point(point: SweepPoint, options: ReplayOptions, prepared: PreparedWorkload | None = None) -> dict[str, Any]:
    """One replay, as a row of the sweep (runs in a worker process); its requests read from
    `prepared` (the workload the points share, parsed once) when given; `slo_attainment` when the
    point has a TTFT objective."""
    replay: Replay = build_replay(options)
    if prepared is not None:
        replay = replace(replay, workload=prepared)
    with tempfile.TemporaryDirectory(prefix="kvtool-sweep-point-") as scratch:
        if _takes_a_folder(replay):
            replay = replace(replay, options={**replay.options, "dir": scratch})
        result = run_trace(replay.workload.requests(), replay.config, replay.connector, replay.options,
                           keep_iterations=False)
    s = result.summary
    row: dict[str, Any] = {
        "capacity_tokens": point.capacity_tokens, "capacity_bytes": point.capacity_bytes,
        "capacity_gib": None if point.capacity_bytes is None else round(point.capacity_bytes / 2**30, 6),
        "tokens_per_block": point.tokens_per_block,
        "tier": s.connector, "fidelity": s.fidelity, "hit_rate": s.hit_rate, "prompt_tokens": s.prompt_tokens,
        "local_hit_tokens": s.local_hit_tokens, "connector_hit_tokens": s.connector_hit_tokens,
        "computed_tokens": s.computed_tokens, "saved_blocks": s.saved_blocks, "loaded_blocks": s.loaded_blocks,
        "connector_evictions": s.connector_evictions, "evictions": s.evictions, "bytes_loaded": s.bytes_loaded,
        "load_gbps": replay.cost_model.load_gbps if replay.cost_model else None,
    }
    if replay.cost_model is not None:
        row.update({f"ttft_{k}_s": v for k, v in ttft_stats(result.recorder.requests).items()})
        if point.ttft_slo is not None:
            row["slo_attainment"] = slo_attainment([r.ttft for r in result.recorder.requests], point.ttft_slo)
        check = load_check(result.recorder.requests)
        row["overloaded"] = None if check is None else check.overloaded
    row.update(failed_checks="; ".join(result.failed_checks), wall_seconds=s.wall_seconds)
    return row


def _takes_a_folder(replay: Replay) -> bool:
    """A connector with a `dir` option the user left to its default (one folder every point would share)."""
    declared = declared_options(replay.connector.scheduler_class) if replay.connector else None
    return "dir" not in replay.options and any(o.name == "dir" for o in declared or ())
