"""`kvtool inspect-layout`: what memory a connector receives for a model and cache config."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kvtool.cli.common import (
    FORMAT_HELP,
    OUTPUT_HELP,
    OutputFormat,
    clean_errors,
    deprecated,
    is_legacy_output_file,
    write_text,
)
from kvtool.inputs import manager_config
from kvtool.manager import compute_layout
from kvtool.report.layout_report import layout_frame, layout_tables, layout_to_dict
from kvtool.report.run_folder import prepare_run_folder, write_file, write_json, write_meta


@clean_errors
def inspect_layout(
    model: Annotated[str, typer.Option(help="Preset name or path to a Hugging Face config.json.")] = "llama-3.1-8b",
    tokens_per_block: Annotated[int, typer.Option(metavar="N", help="Tokens per block (32: TensorRT-LLM's default; "
                                                  "validate uses 4 so that short prompts span many blocks).")] = 32,
    dtype: Annotated[str | None,
                     typer.Option(help="KV dtype (bf16, fp16, fp32, fp8, int8); default: the model's.")] = None,
    gpu_memory: Annotated[str | None, typer.Option(metavar="SIZE", help="Memory for all pools, e.g. 8GiB "
                                                      "[default: 8GiB].")] = None,
    num_slots: Annotated[int | None, typer.Option(help="Slots per pool group (instead of --gpu-memory).")] = None,
    tp: Annotated[int, typer.Option(metavar="N", help="Tensor-parallel ranks: each holds 1/N of the KV heads "
                                    "(an MLA latent whole); N must divide the heads.")] = 1,
    rank: Annotated[int, typer.Option(metavar="R", help="Which tensor-parallel rank's layout to show (0 … N-1).")] = 0,
    format: Annotated[OutputFormat, typer.Option("--format", help=FORMAT_HELP)] = OutputFormat.table,
    output: Annotated[Path | None, typer.Option(metavar="DIR", help=OUTPUT_HELP.format(
        files="layout.json, layout.csv"))] = None,
) -> None:
    """Show the KV cache layout a connector receives.

    Layer groups, regions, pool groups, totals; computed without allocating: pool bases are
    virtual offsets, 2 MiB aligned.
    """
    legacy = is_legacy_output_file(output)
    if legacy:
        deprecated("--output FILE", "--output DIR (layout.json, layout.csv, meta.json) or shell redirection")
    folder = prepare_run_folder(output, "inspect-layout") if output is not None and not legacy else None
    layout = compute_layout(manager_config(model, tokens_per_block, dtype, gpu_memory, num_slots, tp=(tp, rank)))
    text = _layout_text(layout, format)
    if legacy:
        write_text(text, output, Console())
        return
    write_text(text, None, Console())
    if folder is not None:
        write_json(folder / "layout.json", layout_to_dict(layout))
        write_file(folder / "layout.csv", layout_frame(layout).to_csv(index=False))
        write_meta(folder, "inspect-layout")


def _layout_text(layout, format: OutputFormat) -> str:
    if format is OutputFormat.json:
        return json.dumps(layout_to_dict(layout), indent=2)
    if format is OutputFormat.csv:
        return layout_frame(layout).to_csv(index=False)
    buffer = io.StringIO()
    Console(file=buffer, width=160, force_terminal=False).print(layout_tables(layout))
    return buffer.getvalue()
