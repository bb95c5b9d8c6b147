"""`kvtool trace compare A B`: the deltas of two replays; exit 1 past `--max-regression`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import pandas as pd
import typer
from rich.console import Console
from rich.table import Table

from kvtool.cli.common import FORMAT_HELP, ExitCode, OutputFormat, clean_errors, fail, frame_text
from kvtool.errors import InputError
from kvtool.report.trace_compare import DEFAULT_JUDGED, METRICS, Delta, compare_folders


@clean_errors
def trace_compare(
    a: Annotated[Path, typer.Argument(help="Run folder of the reference (trace run or trace sweep --output).")],
    b: Annotated[Path, typer.Argument(help="Run folder to judge against it.")],
    max_regression: Annotated[float | None, typer.Option(metavar="FRACTION", help="Exit 1 when a judged metric "
                                                            "is worse in B by more than this fraction of A "
                                                            "(0.05 = 5 %).")] = None,
    metric: Annotated[list[str], typer.Option(help="A metric to judge (repeatable) [default: "
                                              f"{', '.join(DEFAULT_JUDGED)}].")] = [],
    format: Annotated[OutputFormat, typer.Option("--format", help=FORMAT_HELP)] = OutputFormat.table,
) -> None:
    """Compare two replays, metric by metric.

    Prints A, B and the change of every metric; exit 1 past --max-regression."""
    if max_regression is not None and not max_regression >= 0:
        raise InputError(f"--max-regression must be a fraction >= 0, got {max_regression}")
    for name in metric:
        if name not in METRICS:
            raise InputError(f"unknown metric {name!r}; known: {', '.join(METRICS)}")
    judged = tuple(metric) or DEFAULT_JUDGED
    deltas = compare_folders(a, b)
    _print(deltas, judged, format)
    if max_regression is None:
        return
    worse = [d for d in deltas if d.metric in judged and d.regression > max_regression]
    if worse:
        raise fail("; ".join(f"{d.metric}{f' ({d.point})' if d.point else ''} regressed "
                             f"{_percent(d.regression)} (limit {_percent(max_regression)})" for d in worse),
                   ExitCode.CHECK_FAILED)


def _print(deltas: list[Delta], judged: tuple[str, ...], format: OutputFormat) -> None:
    rows = [{"point": d.point, "metric": d.metric, "a": d.a, "b": d.b, "change": d.change,
             "regression": d.regression, "judged": d.metric in judged} for d in deltas]
    if format is OutputFormat.json:
        print(json.dumps(rows, indent=2))
        return
    if format is OutputFormat.csv:
        print(frame_text(pd.DataFrame(rows), format), end="")
        return
    table = Table(title="trace compare: B against A")
    with_points = any(d.point for d in deltas)
    for column in ("point", "metric", "A", "B", "change")[0 if with_points else 1:]:
        table.add_column(column, justify="left" if column in ("point", "metric") else "right")
    for d in deltas:
        style = "red" if d.regression > 0 and d.metric in judged else None
        name = d.metric + (" *" if d.metric in judged else "")
        change = "-" if d.change is None else f"{100 * d.change:+.2f} %"
        table.add_row(*([d.point] if with_points else []), name, _value(d.a), _value(d.b), change, style=style)
    Console().print(table)
    Console().print("* judged by --max-regression; red: worse in B", highlight=False)


def _value(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,}" if isinstance(value, int) else f"{value:.6g}"


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.2f} %"
