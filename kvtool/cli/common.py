"""What every subcommand shares: exit codes, one clear line per error, the options several commands
take (manager config, connector options) and the progress bar."""

from __future__ import annotations

import contextlib
import functools
import sys
from enum import IntEnum
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvtool.errors import InputError, KvToolError, OutOfMemoryError, UnsupportedTierError
from kvtool.manager import KvCacheManagerConfig
from kvtool.models import load_model
from kvtool.units import parse_size

DEFAULT_GPU_MEMORY = "8GiB"


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


def manager_config(model: str, tokens_per_block: int, dtype: str | None, gpu_memory: str | None,
                   num_slots: int | None, default_memory: str = DEFAULT_GPU_MEMORY,
                   device: str | None = None) -> KvCacheManagerConfig:
    """A validated manager config from command-line values (InputError for bad ones)."""
    if gpu_memory is not None and num_slots is not None:
        raise InputError("give --gpu-memory or --num-slots, not both")
    memory = None if num_slots is not None else parse_size(gpu_memory or default_memory)
    config = KvCacheManagerConfig(load_model(model, dtype), tokens_per_block, num_slots=num_slots,
                                  memory_bytes=memory, device=device)
    config.validate()
    return config


def parse_options(pairs: list[str]) -> dict[str, str]:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InputError(f"connector option {pair!r} is not KEY=VALUE")
        options[key] = value
    return options


@contextlib.contextmanager
def progress_bar(label: str, total: int, console: Console) -> Iterator[Callable[..., None]]:
    """A transient bar on `console`; yields `update(info=, completed=, advance=)` to move it (fields
    left out stay as they are)."""
    with Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        task = progress.add_task(label, total=total, info="")

        def update(info: str | None = None, completed: int | None = None, advance: int | None = None) -> None:
            fields = {} if info is None else {"info": info}
            progress.update(task, completed=completed, advance=advance, **fields)

        yield update
