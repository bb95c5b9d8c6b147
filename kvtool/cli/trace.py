"""`kvtool trace run`: replay a request workload through the bundled manager, scheduler and connector."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import pandas as pd
import typer
from rich.console import Console
from rich.table import Table

from kvtool.cli.common import (CONNECTOR_CHOICES, FORMAT_HELP, OUTPUT_HELP, ExitCode, OutputFormat, clean_errors,
                               connector_options, deprecated, fail, frame_text, manager_config, parse_options,
                               progress_bar)
from kvtool.connectors.registry import load_connector
from kvtool.engine.engine import EngineConfig
from kvtool.engine.scheduler import SchedulerConfig
from kvtool.engine.trace import TraceSummary, run_trace
from kvtool.engine.workload import load_workload
from kvtool.errors import InputError
from kvtool.report.run_folder import check_writable_file, prepare_run_folder, write_file, write_json, write_meta

trace_app = typer.Typer(no_args_is_help=True, help="Replay request workloads.")
DEFAULT_NUM_SLOTS = 1024


@trace_app.command("run")
@clean_errors
def trace_run(
    workload: Annotated[Path, typer.Argument(help="JSON Lines workload (schema: workloads/README.md).")],
    model: Annotated[str, typer.Option(help="Preset name or path to a Hugging Face config.json.")] = "tiny",
    tokens_per_block: Annotated[int, typer.Option(metavar="N", help="Tokens per block.")] = 32,
    num_slots: Annotated[Optional[int], typer.Option(metavar="N", help="Slots per pool group [default: 1024].")] = None,
    gpu_memory: Annotated[Optional[str], typer.Option(metavar="SIZE", help="Memory for all pools instead of "
                                                      "--num-slots.")] = None,
    max_batch_size: Annotated[int, typer.Option(help="Requests per iteration at most.")] = 64,
    max_num_tokens: Annotated[int, typer.Option(help="Tokens per iteration at most (the token budget).")] = 8192,
    chunk_size: Annotated[Optional[int], typer.Option(metavar="N", help="Prefill chunk size [default: the token "
                                                      "budget only].")] = None,
    connector: Annotated[str, typer.Option(help=f"none, {CONNECTOR_CHOICES}.")] = "none",
    connector_dir: Annotated[Optional[Path], typer.Option(metavar="DIR", help="Folder of the disk connector "
                                                         "(its dir option).")] = None,
    connector_opt: Annotated[list[str], typer.Option(help="KEY=VALUE option for the connector (repeatable).")] = [],
    no_local_reuse: Annotated[bool, typer.Option("--no-local-reuse", help="Never reuse the local radix tree.")] = False,
    seed: Annotated[int, typer.Option(help="Seed of the KV fingerprints.")] = 0,
    num_ranks: Annotated[int, typer.Option(help="Ranks: rank 0 here, the others as processes in a "
                                           "torch.distributed group (gloo on CPU, NCCL on GPU), each with its own "
                                           "pools and connector worker.")] = 1,
    tp: Annotated[int, typer.Option(metavar="N", help="Tensor-parallel: each rank holds 1/N of the KV heads "
                                    "(N = --num-ranks, dividing the heads).")] = 1,
    format: Annotated[OutputFormat, typer.Option("--format", help=FORMAT_HELP)] = OutputFormat.table,
    output: Annotated[Optional[Path], typer.Option(metavar="DIR", help=OUTPUT_HELP.format(
        files="summary.json, summary.csv"))] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", metavar="FILE", hidden=True,
                                                     help="Deprecated: use --output DIR.")] = None,
) -> None:
    """Replay WORKLOAD; exit 1 on integrity errors, failed requests or broken invariants."""
    for name, value in (("max-batch-size", max_batch_size), ("max-num-tokens", max_num_tokens),
                        ("chunk-size", chunk_size), ("num-ranks", num_ranks), ("tp", tp)):
        if value is not None and value <= 0:
            raise InputError(f"--{name} must be positive, got {value}")
    if json_out is not None:
        deprecated("--json FILE", "--output DIR (summary.json) or --format json")
        check_writable_file(json_out, "--json")
    folder = prepare_run_folder(output) if output is not None else None
    requests = load_workload(workload)
    config = EngineConfig(
        manager_config(model, tokens_per_block, None, gpu_memory,
                       num_slots if num_slots is not None or gpu_memory is not None else DEFAULT_NUM_SLOTS),
        SchedulerConfig(max_batch_size, max_num_tokens, chunk_size, local_reuse=not no_local_reuse),
        seed=seed, num_ranks=num_ranks, tp_size=tp, ranks_as_processes=True)
    spec = None if connector == "none" else load_connector(connector)
    if connector_dir is not None and spec is None:
        raise InputError("--connector-dir is the disk connector's folder: give --connector disk")
    options = connector_options(spec, connector_opt, connector_dir) if spec else parse_options(connector_opt)
    if options and spec is None:
        raise InputError("--connector-opt needs a --connector")
    console = Console(stderr=True)
    with progress_bar("trace", len(requests), console) as update:

        def on_iteration(engine) -> None:
            done = sum(not s.is_live for s in engine.states.values())
            update(completed=done, info=f"iteration {engine.iteration}")

        result = run_trace(requests, config, spec, options, on_iteration)
    _print_summary(result.summary, format)
    for line in result.issues:
        console.print(f"[red]{line}[/red]", highlight=False)
    if json_out is not None:
        write_json(json_out, result.summary.as_dict())
    if folder is not None:
        write_json(folder / "summary.json", result.summary.as_dict())
        write_file(folder / "summary.csv", frame_text(pd.DataFrame([result.summary.as_dict()]), OutputFormat.csv))
        write_meta(folder, "trace")
    if result.failed_checks:
        raise fail("; ".join(result.failed_checks), ExitCode.CHECK_FAILED)


def _print_summary(summary: TraceSummary, format: OutputFormat) -> None:
    if format is OutputFormat.table:
        Console().print(_summary_table(summary))
    elif format is OutputFormat.json:
        print(json.dumps(summary.as_dict(), indent=2))
    else:
        print(frame_text(pd.DataFrame([summary.as_dict()]), format), end="")


def _summary_table(summary: TraceSummary) -> Table:
    table = Table(title=f"trace: {summary.model} · connector {summary.connector}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.as_dict().items():
        if key not in ("model", "connector"):
            table.add_row(key, "-" if value is None else str(value))
    return table
