"""The `kvtool` command line: a thin typer layer over library functions."""

from __future__ import annotations

import typer

from kvtool.cli.bench import bench
from kvtool.cli.inspect_layout import inspect_layout
from kvtool.cli.trace import trace_app
from kvtool.cli.validate import validate

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="kvtool: develop, benchmark and conformance-check KV cache connectors.")
app.command("inspect-layout")(inspect_layout)
app.command("bench")(bench)
app.add_typer(trace_app, name="trace")
app.command("validate")(validate)


@app.callback()
def _root() -> None:
    """kvtool: develop, benchmark and conformance-check KV cache connectors."""


def main() -> None:
    app()
