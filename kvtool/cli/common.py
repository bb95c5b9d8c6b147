"""What every subcommand shares: exit codes, one clear line per error, the options several commands
take (manager config, connector options) and the progress bar."""

from __future__ import annotations

import contextlib
import enum
import functools
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pandas as pd
import torch
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from typer.core import TyperCommand, TyperGroup

from kvtool.connector.loader import ConnectorSpec
from kvtool.connector.options import declared_options
from kvtool.connectors.registry import BUILTIN_CONNECTORS
from kvtool.errors import InputError, KvToolError, OutOfMemoryError, UnsupportedTierError, did_you_mean
from kvtool.inputs import warn
from kvtool.report.run_folder import settled_run_folders, write_file

if TYPE_CHECKING:
    from typer._click import exceptions as cli_errors
else:
    try:
        from typer._click import exceptions as cli_errors  # typer >= 0.29 carries its own click
    except ImportError:                                       # older typer runs on click itself
        from click import exceptions as cli_errors

CONNECTOR_CHOICES = f"{', '.join(BUILTIN_CONNECTORS)}, MODULE:SCHED:WORKER or path/to/file.py:SCHED:WORKER"


class ExitCode(enum.IntEnum):
    OK = 0
    CHECK_FAILED = 1
    USAGE = 2


F = TypeVar("F", bound=Callable)
_INPUT_ERRORS = (InputError, OutOfMemoryError, UnsupportedTierError)


_NO_ARGS_IS_HELP = getattr(cli_errors, "NoArgsIsHelpError", ())   # click >= 8.2


class OneLineErrorsGroup(TyperGroup):
    """The root command: a usage error from the command-line parser (a bad value, an unknown
    option) is one line on stderr and exit 2, like kvtool's own errors."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        warnings.formatwarning = _one_line_warning
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _NO_ARGS_IS_HELP as exc:
            print(exc.ctx.get_help() if exc.ctx else exc.format_message())
            code = int(ExitCode.USAGE)
        except cli_errors.UsageError as exc:
            where = f" (see {exc.ctx.command_path} --help)" if exc.ctx is not None else ""
            print(f"kvtool: error: {_usage_message(exc)}{where}", file=sys.stderr)
            code = int(ExitCode.USAGE)
        except cli_errors.ClickException as exc:
            print(f"kvtool: error: {exc.format_message()}", file=sys.stderr)
            code = exc.exit_code
        except typer.Abort:
            print("kvtool: aborted", file=sys.stderr)
            code = 130
        code = code if isinstance(code, int) else 0
        if standalone_mode:
            sys.exit(code)
        return code


def _usage_message(exc) -> str:
    """The parser's message, as click words it: typer's type checks (pydantic) put "Value error, " in
    front of a bad choice ("Invalid value for '--format': 'yaml' is not one of 'table', 'json',
    'csv'."), which is said here as every other option's bad value is."""
    return exc.format_message().replace(": Value error, ", ": ", 1)


class ConnectorHelpCommand(TyperCommand):
    """A command with `--connector-help`: given that flag, its required arguments (a workload) may
    be left out, as `--help` lets them be."""

    def parse_args(self, ctx, args):
        if "--connector-help" in args:
            for param in self.params:
                param.required = False
        return super().parse_args(ctx, args)


def suggest(name: str, choices) -> str:
    """" (did you mean 'x'?)" for the closest of `choices` to a mistyped `name`, or "" (for the end
    of an error message: `f"unknown scenario {name!r}{suggest(name, SCENARIOS)}; ..."`)."""
    return did_you_mean(name, choices)


def kvtool_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("kvtool")
    except PackageNotFoundError:       # run from a checkout (PYTHONPATH), as on the GPU machine
        from kvtool import __version__
        return f"{__version__} (from a checkout)"


def pages_device(name: str | None, default: str) -> str:
    """--device: `cpu` or `cuda` (`default` when not given); InputError for another name, or for
    cuda on a machine without a CUDA GPU."""
    name = default if name is None else name
    if name not in ("cpu", "cuda"):
        raise InputError(f"--device must be cpu or cuda, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda needs a CUDA GPU, and this machine has none")
    return name


def fail(message: str, code: ExitCode = ExitCode.USAGE) -> typer.Exit:
    print(f"kvtool: error: {message}", file=sys.stderr)
    return typer.Exit(int(code))


def clean_errors(command: F) -> F:
    """Run `command`; a kvtool error becomes one line on stderr and exit 2 (input) or 1 (a check).
    A command that fails puts back an earlier run it was replacing and removes the folders it
    created and left empty (`run_folder.settled_run_folders`)."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        with settled_run_folders():
            try:
                return command(*args, **kwargs)
            except _INPUT_ERRORS as exc:
                raise fail(str(exc), ExitCode.USAGE) from None
            except KvToolError as exc:
                raise fail(str(exc), ExitCode.CHECK_FAILED) from None

    return wrapper  # type: ignore[return-value]


def write_text(text: str, output: Path | None, console: Console) -> None:
    """Print `text`, or write it to `output` (a failed write is an input error)."""
    if output is None:
        console.print(text, markup=False, highlight=False, soft_wrap=True)
        return
    write_file(output, text)


def print_connector_help(spec: ConnectorSpec) -> None:
    """The options `spec` declares, one per line (its built-in presets named), on stdout."""
    declared = declared_options(spec.scheduler_class)
    print(f"connector {spec.name} ({spec.scheduler_class.__name__}, {spec.worker_class.__name__})")
    if spec.options:
        print("  preset: " + ", ".join(f"{k}={v}" for k, v in spec.options.items()))
    if declared is None:
        print("  declares no options (set kvtool_options on the scheduler class to have them checked)")
    for option in declared or ():
        print(f"  --connector-opt {option.describe()}")


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """A library's warning on the terminal as kvtool's own: one line, no source excerpt."""
    text = str(message)
    return f"kvtool: warning: {text.removeprefix('kvtool ')}\n"


def say(message: str) -> None:
    """One line on stderr about what this run does (not a warning, not an error)."""
    print(f"kvtool: {message}", file=sys.stderr)


@contextlib.contextmanager
def progress_bar(label: str, total: int, console: Console) -> Iterator[Callable[..., None]]:
    """A transient bar on `console`; yields `update(info=, completed=, advance=)` to move it (fields
    left out stay as they are). Without a terminal (a CI log) there is no bar: a live display
    there would only leave a blank line in front of whatever comes next."""
    if not console.is_terminal:
        yield lambda info=None, completed=None, advance=None: None
        return
    with Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        task = progress.add_task(label, total=total, info="")

        def update(info: str | None = None, completed: int | None = None, advance: int | None = None) -> None:
            fields: dict[str, Any] = {} if info is None else {"info": info}
            progress.update(task, completed=completed, advance=advance, **fields)

        yield update


class OutputFormat(str, enum.Enum):
    """What a command prints on stdout (machine-readable files go to --output DIR)."""

    table = "table"
    json = "json"
    csv = "csv"


FORMAT_HELP = "What to print on stdout: table, json or csv."
OUTPUT_HELP = "Run folder for meta.json and every machine-readable file ({files})."
LEGACY_FILE_SUFFIXES = (".json", ".csv", ".txt", ".xml")


def is_legacy_output_file(output: Path | None) -> bool:
    """`--output` naming a file, as before the run-folder convention (kept for one release)."""
    return output is not None and (output.is_file() or output.suffix.lower() in LEGACY_FILE_SUFFIXES)


def deprecated(old: str, new: str) -> None:
    warn(f"{old} is deprecated and goes away in the next release; use {new}")


def frame_text(frame: pd.DataFrame, format: OutputFormat) -> str:
    """A table as JSON records or CSV text (the `table` format is each command's own)."""
    if format is OutputFormat.json:
        return frame.to_json(orient="records", indent=2) + "\n"
    return frame.to_csv(index=False)
