"""The `kvtool` command line: a thin typer layer over library functions."""

from __future__ import annotations

from typing import Annotated

import typer

from kvtool.cli.bench import bench
from kvtool.cli.common import ConnectorHelpCommand, OneLineErrorsGroup, kvtool_version
from kvtool.cli.inspect_layout import inspect_layout
from kvtool.cli.trace import trace_app
from kvtool.cli.trace_compare import trace_compare
from kvtool.cli.trace_generate import trace_generate
from kvtool.cli.trace_sweep import trace_sweep
from kvtool.cli.validate import validate

app = typer.Typer(cls=OneLineErrorsGroup, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode=None, help="kvtool: develop, benchmark and conformance-check KV cache connectors.")
# `kvtool --help` lists each command by the first sentence of its docstring, cut at about 45
# characters: that sentence is kept short. bench's and validate's docstrings open with a long
# sentence, so their line is given here.
app.command("inspect-layout")(inspect_layout)
app.command("bench", short_help="Time connector transfers against the link.")(bench)
trace_app.command("sweep", cls=ConnectorHelpCommand)(trace_sweep)
trace_app.command("compare")(trace_compare)
trace_app.command("generate")(trace_generate)
app.add_typer(trace_app, name="trace")
app.command("validate", short_help="Conformance-check a KV cache connector.")(validate)


def _print_version(value: bool) -> None:
    if value:
        print(f"kvtool {kvtool_version()}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """kvtool: develop, benchmark and conformance-check KV cache connectors."""


def main() -> None:
    app()
