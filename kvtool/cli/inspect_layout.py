"""`kvtool inspect-layout`: what memory a connector receives for a model and cache config."""

from __future__ import annotations

import io
import json
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from kvtool.cli.common import clean_errors, manager_config, write_text
from kvtool.manager import compute_layout
from kvtool.report.layout_report import layout_frame, layout_tables, layout_to_dict

class LayoutFormat(str, Enum):
    table = "table"
    json = "json"
    csv = "csv"


@clean_errors
def inspect_layout(
    model: Annotated[str, typer.Option(help="Preset name or path to a Hugging Face config.json.")] = "llama-3.1-8b",
    tokens_per_block: Annotated[int, typer.Option(help="Tokens per block.")] = 32,
    dtype: Annotated[Optional[str], typer.Option(help="KV dtype (bf16, fp16, fp32, fp8, int8); default: the model's.")] = None,
    gpu_memory: Annotated[Optional[str], typer.Option(help="Memory for all pools, e.g. 8GiB (default 8GiB).")] = None,
    num_slots: Annotated[Optional[int], typer.Option(help="Slots per pool group (instead of --gpu-memory).")] = None,
    format: Annotated[LayoutFormat, typer.Option("--format", help="table, json or csv.")] = LayoutFormat.table,
    output: Annotated[Optional[Path], typer.Option(help="Write to this file instead of stdout.")] = None,
) -> None:
    """Show the layout a connector receives: layer groups, regions, pool groups, totals.

    Computed without allocating: pool bases are virtual offsets, 2 MiB aligned.
    """
    layout = compute_layout(manager_config(model, tokens_per_block, dtype, gpu_memory, num_slots))
    if format is LayoutFormat.json:
        text = json.dumps(layout_to_dict(layout), indent=2)
    elif format is LayoutFormat.csv:
        text = layout_frame(layout).to_csv(index=False)
    else:
        buffer = io.StringIO()
        Console(file=buffer, width=160, force_terminal=False).print(layout_tables(layout))
        text = buffer.getvalue()
    write_text(text, output, Console())
