"""What every subcommand shares: exit codes and turning kvtool errors into one clear line."""

from __future__ import annotations

import functools
import sys
from enum import IntEnum
from pathlib import Path
from typing import Callable, TypeVar

import typer
from rich.console import Console

from kvtool.errors import InputError, KvToolError, OutOfMemoryError, UnsupportedTierError


class ExitCode(IntEnum):
    OK = 0
    CHECK_FAILED = 1
    USAGE = 2


F = TypeVar("F", bound=Callable)
_INPUT_ERRORS = (InputError, OutOfMemoryError, UnsupportedTierError)


def fail(message: str, code: ExitCode = ExitCode.USAGE) -> typer.Exit:
    print(f"kvtool: error: {message}", file=sys.stderr)
    return typer.Exit(int(code))


def clean_errors(command: F) -> F:
    """Run `command`; a kvtool error becomes one line on stderr and exit 2 (input) or 1 (a check)."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
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
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text)
    except OSError as exc:
        raise InputError(f"cannot write {output}: {exc.strerror or exc}") from None
