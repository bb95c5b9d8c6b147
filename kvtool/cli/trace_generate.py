"""`kvtool trace generate KIND`: a synthetic workload (chat, docqa, agentic) as kvtool JSON Lines."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kvtool.cli.common import clean_errors
from kvtool.errors import InputError
from kvtool.report.run_folder import check_writable_file
from kvtool.workloads.generate import KINDS, GeneratorConfig, write_workload

_DEFAULTS = GeneratorConfig("chat")


@clean_errors
def trace_generate(
    kind: Annotated[str, typer.Argument(metavar="KIND", help=f"{'|'.join(KINDS)}: multi-turn chat with a shared "
                                        "system prompt, questions over repeated documents, agentic tool loops.")],
    output: Annotated[Path, typer.Option(metavar="FILE", help="The JSON Lines file to write (a file, not a run "
                                              "folder: the trace is the one thing this command writes).")],
    requests: Annotated[int, typer.Option(help="Requests in all.")] = _DEFAULTS.num_requests,
    seed: Annotated[int, typer.Option(help="Seed: the same seed and knobs give the same file.")] = 0,
    rate: Annotated[float, typer.Option(help="Sessions started per second (Poisson).")] = _DEFAULTS.rate,
    think_seconds: Annotated[float, typer.Option(help="Seconds between two turns of a session.")]
    = _DEFAULTS.think_seconds,
    prefix_tokens: Annotated[int, typer.Option(help="System prompt (chat, agentic) or document (docqa) tokens.")]
    = _DEFAULTS.prefix_tokens,
    turn_tokens: Annotated[int, typer.Option(help="User message, question or tool output tokens.")]
    = _DEFAULTS.turn_tokens,
    output_tokens: Annotated[int, typer.Option(help="Tokens each request generates.")] = _DEFAULTS.output_tokens,
    turns: Annotated[int, typer.Option(help="Turns of a conversation, steps of an agent run (docqa: 1).")]
    = _DEFAULTS.turns,
    documents: Annotated[int, typer.Option(help="Distinct documents (docqa).")] = _DEFAULTS.documents,
    zipf: Annotated[float, typer.Option(help="Zipf exponent of the documents' popularity (docqa).")]
    = _DEFAULTS.zipf,
) -> None:
    """Write a synthetic workload file.

    kvtool JSON Lines, for `kvtool trace run` / `sweep`."""
    config = GeneratorConfig(kind, requests, seed, rate, think_seconds, prefix_tokens, turn_tokens, output_tokens,
                             turns, documents, zipf)
    config.check()
    check_writable_file(output, "--output")
    partial = output.with_name(output.name + ".partial")
    try:
        with partial.open("w", encoding="utf-8") as handle:
            count = write_workload(config, handle)
        os.replace(partial, output)   # a failure leaves any earlier file whole
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise InputError(f"cannot write {output}: {exc.strerror or exc}") from None
    Console(stderr=True).print(f"wrote {count} {kind} requests to {output}", highlight=False)
