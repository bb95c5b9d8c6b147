"""`kvtool trace run`: replay a request workload through the bundled manager, scheduler and connector."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import pandas as pd
import typer
from rich.console import Console
from rich.table import Table

from kvtool.cli.common import (
    CONNECTOR_CHOICES,
    FORMAT_HELP,
    OUTPUT_HELP,
    ConnectorHelpCommand,
    ExitCode,
    OutputFormat,
    clean_errors,
    deprecated,
    fail,
    frame_text,
    print_connector_help,
    progress_bar,
    say,
    warn,
)
from kvtool.cli.trace_options import ConnectorHelp, with_replay_options
from kvtool.connectors.registry import load_connector
from kvtool.errors import InputError
from kvtool.inputs import parse_options
from kvtool.report.instances_report import instances_table, latency_table, write_instances_folder
from kvtool.report.run_folder import check_writable_file, prepare_run_folder, write_json, write_meta
from kvtool.report.timeline import TimelineRecorder
from kvtool.trace.instances import DEFAULT_SYNC_WINDOW_S, InstancesPlan, Route, fleet_rows, run_instances
from kvtool.trace.replay import TraceResult, TraceSummary, run_trace
from kvtool.trace.report import cost_model_text, tier_table, ttft_report, ttft_table, write_trace_folder
from kvtool.trace.setup import (
    Replay,
    ReplayOptions,
    build_replay,
    check_before_replay,
    decode_check_note,
    note_store_folder,
)
from kvtool.trace.tier_size import tier_note
from kvtool.vllm_compat.entry import VLLM_COMPAT, run_vllm_trace
from kvtool.vllm_compat.install import VLLM_VERSION, require_vllm
from kvtool.vllm_compat.trace_replay import VllmTraceShape

trace_app = typer.Typer(no_args_is_help=True, help="Replay request workloads.")


@trace_app.command("run", cls=ConnectorHelpCommand)
@clean_errors
@with_replay_options
def trace_run(
    options: ReplayOptions,
    tokens_per_block: Annotated[int, typer.Option(metavar="N", help="Tokens per block (32: TensorRT-LLM's default; "
                                                  "validate uses 4 so that short prompts span many blocks).")] = 32,
    connector: Annotated[str, typer.Option(help=f"none, {CONNECTOR_CHOICES}.")] = "none",
    connector_dir: Annotated[Path | None, typer.Option(metavar="DIR", help="Folder of the disk connector "
                                                         "(its dir option).")] = None,
    connector_help: ConnectorHelp = False,
    num_ranks: Annotated[int, typer.Option(help="Ranks: rank 0 here, the others as processes in a "
                                           "torch.distributed group (gloo on CPU, NCCL on GPU), each with its own "
                                           "pools and connector worker.")] = 1,
    tp: Annotated[int, typer.Option(metavar="N", help="Tensor-parallel: each rank holds 1/N of the KV heads "
                                    "(N = --num-ranks, dividing the heads) and the cost model divides compute and "
                                    "weights by N; in blocks fidelity --tp alone replays rank 0's shard (the GPU "
                                    "pool and tier sizes are a GPU's).")] = 1,
    baseline: Annotated[bool, typer.Option("--baseline", help="Also replay without the connector, and compare "
                                           "TTFT and compute saved.")] = False,
    timeline: Annotated[Path | None, typer.Option(metavar="FILE", help="Write a Chrome trace / Perfetto "
                                                     "timeline of the replay.")] = None,
    format: Annotated[OutputFormat, typer.Option("--format", help=FORMAT_HELP)] = OutputFormat.table,
    output: Annotated[Path | None, typer.Option(metavar="DIR", help=OUTPUT_HELP.format(
        files="summary.json, summary.csv, requests.csv, iterations.csv, ttft_cdf.png"))] = None,
    json_out: Annotated[Path | None, typer.Option("--json", metavar="FILE", hidden=True,
                                                     help="Deprecated: use --output DIR.")] = None,
    instances: Annotated[int, typer.Option(metavar="N", help="Engine instances, each in its own process with its "
                                           "own GPU pool and connector (a shared store: redis, mooncake, or their "
                                           "-index tiers for block fidelity).")] = 1,
    route: Annotated[Route, typer.Option(help="How requests reach instances: round-robin, or prefix "
                                         "(cache-aware).")] = Route.ROUND_ROBIN,
    sync_window: Annotated[float, typer.Option(metavar="SECONDS", help="No instance runs more than this many "
                                               "simulated seconds ahead of another.")] = DEFAULT_SYNC_WINDOW_S,
) -> None:
    """Replay a workload through a connector.

    Exit 1 on integrity errors, failed requests or broken invariants."""
    if connector_help:
        if connector == "none":
            raise InputError("--connector-help lists a connector's options: give --connector NAME")
        print_connector_help(load_connector(connector, options.compat))
        return
    if json_out is not None:
        deprecated("--json FILE", "--output DIR (summary.json) or --format json")
        check_writable_file(json_out, "--json")
    if timeline is not None:
        check_writable_file(timeline, "--timeline")
    options = replace(options, tokens_per_block=tokens_per_block, connector=connector,
                      connector_dir=connector_dir, num_ranks=num_ranks, tp=tp)
    if options.compat == VLLM_COMPAT:
        if instances != 1 or baseline or timeline or json_out or num_ranks != 1 or tp != 1:
            raise InputError("--compat vllm replays one engine of one worker: drop --instances, --baseline, "
                             "--timeline, --json, --num-ranks and --tp")
        _run_vllm(options, output, format)
        return
    if instances != 1:
        _run_instances(options, instances, route, sync_window, baseline, timeline, json_out, output, format)
        return
    replay = build_replay(options)
    if baseline and replay.connector is None:
        raise InputError("--baseline compares with a run without the connector: give a --connector")
    if baseline and replay.cost_model is None:
        raise InputError(BASELINE_NEEDS_COST_MODEL)
    check_before_replay(replay)
    folder = prepare_run_folder(output, "trace") if output is not None else None
    note_store_folder(replay)
    console = Console(stderr=True)
    for note in replay_notes(replay):
        say(note)
    recorder = TimelineRecorder() if timeline is not None else None
    result = _replay(replay, console, [recorder] if recorder else [])
    base = _replay(replace(replay, connector=None, options={}), console, []) if baseline else None
    _print_summary(result.summary, format)
    ttft = ttft_report(result, replay.cost_model, base)
    overload = ttft.get("load", {}).get("note")
    if overload:
        warn(overload)
    if format is OutputFormat.table:
        Console().print(tier_table(result.summary))
        if replay.gpu_pool is not None:
            Console().print(replay.gpu_pool.describe(result.summary.model), highlight=False, markup=False)
        if ttft and replay.cost_model is not None:   # (a TTFT report comes from the cost model)
            Console().print(ttft_table(ttft, result.summary.connector))
            Console().print(cost_model_text(replay.cost_model.assumptions()), highlight=False, markup=False)
    for line in result.issues:
        console.print(f"[red]{line}[/red]", highlight=False)
    if json_out is not None:
        write_json(json_out, result.summary.as_dict())
    if recorder is not None and timeline is not None:   # (one is made for the other)
        recorder.write(timeline)
    if folder is not None:
        write_trace_folder(folder, result, replay.cost_model, ttft, base,
                           {"workload": str(options.workload), "workload_format": replay.workload.format,
                            "seed": options.seed, "connector_options": replay.options, **replay_meta(replay)})
    if result.failed_checks:
        raise fail("; ".join(result.failed_checks), ExitCode.CHECK_FAILED)


def _run_vllm(options: ReplayOptions, output: Path | None, format: OutputFormat) -> None:
    """The workload through a vLLM connector (`kvtool.vllm_compat.trace_replay`), after kvtool's host
    connector through kvtool's engine on the same workload and pool (the reference, in this run)."""
    if options.connector == "none":
        raise InputError("--compat vllm replays through a vLLM connector: give --connector TARGET")
    require_vllm()                      # before the reference replay: exit 2 at once where vLLM is missing
    replay = build_replay(replace(options, connector="host", connector_opt=(), compat=None))
    if replay.config.fidelity != "bytes" or replay.cost_model is not None:
        raise InputError("--compat vllm replays in bytes fidelity at 10 ms a step: a kvtool workload, without "
                         "--fidelity blocks or --cost-model")
    check_before_replay(replay)
    folder = prepare_run_folder(output, "trace") if output is not None else None
    reference = _replay(replay, Console(stderr=True), [])
    shape = VllmTraceShape(options.tokens_per_block, reference.summary.gpu_pool_tokens // options.tokens_per_block + 1,
                           replay.config.scheduler.max_batch_size, replay.config.scheduler.max_num_tokens,
                           replay.config.iteration_seconds)
    vllm = run_vllm_trace(options.connector, parse_options(list(options.connector_opt)), replay.workload.requests(),
                          reference.summary.model, shape)
    rows = {"vllm": vllm, "reference": reference.summary.as_dict()}
    _print_vllm(rows, format)
    if folder is not None:
        write_json(folder / "summary.json", rows)
        write_meta(folder, "trace", workload=str(options.workload), connector=options.connector, vllm=VLLM_VERSION)
    failed = [f"{key} {vllm[key]}" for key in ("integrity_errors", "failed_requests", "invariant_errors") if vllm[key]]
    if failed or reference.failed_checks:
        raise fail("; ".join(failed + [f"reference: {c}" for c in reference.failed_checks]), ExitCode.CHECK_FAILED)


def _print_vllm(rows: dict[str, dict], format: OutputFormat) -> None:
    if format is OutputFormat.json:
        print(json.dumps(rows, indent=2))
        return
    if format is not OutputFormat.table:
        print(frame_text(pd.DataFrame(list(rows.values())), format), end="")
        return
    table = Table(title=f"trace through vLLM {VLLM_VERSION}: {rows['vllm']['connector']} · reference "
                        f"{rows['reference']['connector']} (kvtool's engine)")
    for column in ("metric", "vLLM connector", "reference"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for key, value in rows["vllm"].items():
        if key not in ("model", "connector"):
            other = rows["reference"][key]
            table.add_row(SUMMARY_LABELS.get(key, key), "-" if value is None else str(value),
                          "-" if other is None else str(other))
    Console().print(table)


def _run_instances(options: ReplayOptions, instances: int, route: Route, sync_window: float, baseline: bool,
                   timeline: Path | None, json_out: Path | None, output: Path | None,
                   format: OutputFormat) -> None:
    if instances < 1:
        raise InputError(f"--instances must be positive, got {instances}")
    if baseline or timeline or json_out:
        raise InputError("--baseline, --timeline and --json replay one instance: drop them or --instances")
    if not sync_window > 0:
        raise InputError(f"--sync-window must be a positive number of seconds, got {sync_window}")
    replay = build_replay(options)
    check_before_replay(replay)
    folder = prepare_run_folder(output, "trace") if output is not None else None
    note_store_folder(replay)
    if replay.load_rate_note:
        say(replay.load_rate_note)
    plan = InstancesPlan(options, instances, route, sync_window)
    with progress_bar("instances", instances, Console(stderr=True)) as update:
        rows, total = fleet_rows(run_instances(plan, lambda finished: update(completed=finished)))
    if format is OutputFormat.table:
        Console().print(instances_table(rows + [total], f"trace over {instances} instances · {options.connector} "
                                                          f"· {route.value}"))
        latencies = latency_table(rows + [total], "TTFT and TPOT (cost model), load (prefill work / fleet mean)")
        if latencies is not None:
            Console().print(latencies)
    elif format is OutputFormat.json:
        print(json.dumps({"instances": rows, "all": total}, indent=2))
    else:
        print(frame_text(pd.DataFrame(rows + [total]), format), end="")
    if folder is not None:
        write_instances_folder(folder, rows, total, {"workload": str(options.workload), "route": route.value,
                                                     "instances": instances, "sync_window_s": sync_window,
                                                     "connector": options.connector,
                                                     "cost_model": replay.cost_model.assumptions()
                                                     if replay.cost_model else None, **replay_meta(replay)})
    if total["failed_checks"]:
        raise fail(total["failed_checks"], ExitCode.CHECK_FAILED)


BASELINE_NEEDS_COST_MODEL = ("--baseline compares TTFT with and without the connector, and this replay has no cost "
                             "model (off by default for kvtool workloads: 10 ms an iteration): add --cost-model "
                             "(--gpu and --model say what it prices)")


def replay_notes(replay: Replay) -> list[str]:
    """What to say on stderr before a replay: sizes in SI units, where the load rate came from, a
    tier no larger than the GPU pool, what bytes fidelity's decode checks will cost."""
    return [n for n in (*replay.notes, replay.load_rate_note, tier_note(replay), decode_check_note(replay)) if n]


def replay_meta(replay: Replay) -> dict:
    """meta.json's keys of a replay besides the command's: the GPU pool's derivation, the load rate's source."""
    return {**({"gpu_pool": replay.gpu_pool.as_dict()} if replay.gpu_pool else {}),
            **({"load_gbps_from": replay.load_rate_source} if replay.load_rate_source else {})}


def _replay(replay: Replay, console: Console, subscribers: list) -> TraceResult:
    total = replay.workload.count()
    label = "trace" if replay.connector else "trace (no connector)"
    with progress_bar(label, total, console) as update:
        def on_iteration(engine) -> None:
            if engine.iteration % 64 == 0:
                update(completed=engine.stats.num_finished, info=f"iteration {engine.iteration}")

        return run_trace(replay.workload.requests(), replay.config, replay.connector, replay.options, on_iteration,
                         subscribers)


def _print_summary(summary: TraceSummary, format: OutputFormat) -> None:
    if format is OutputFormat.table:
        Console().print(_summary_table(summary))
    elif format is OutputFormat.json:
        print(json.dumps(summary.as_dict(), indent=2))
    else:
        print(frame_text(pd.DataFrame([summary.as_dict()]), format), end="")


SUMMARY_LABELS = {"computed_tokens": "computed_tokens (prefill + decode)"}
"""Rows of the summary table whose key alone reads as something else: the tier table's
`computed (prompt only)` counts prompt tokens, this one every token a pass computed."""


def _summary_table(summary: TraceSummary) -> Table:
    table = Table(title=f"trace: {summary.model} · connector {summary.connector}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.as_dict().items():
        if key not in ("model", "connector"):
            table.add_row(SUMMARY_LABELS.get(key, key), "-" if value is None else str(value))
    return table
