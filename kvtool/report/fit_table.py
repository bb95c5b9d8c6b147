"""Tables that fit the console without cutting a cell: no column is ever ellipsized. A table too
wide for the console is printed as several, each repeating the columns that name a row (the
connector, the direction, ...), so every value stays whole and next to what it belongs to."""

from __future__ import annotations

import sys

from rich.console import Console

BORDER = 3
"""Characters a column adds beside its text (a rule and a space each side)."""


def report_width(at_least: int) -> int:
    """The width tables are laid out for: the terminal's when stdout is one (a table wider than it
    would wrap line by line), else at least `at_least` columns (a log or a pipe has no width)."""
    console = Console()
    return console.width if sys.stdout.isatty() else max(at_least, console.width)


def table_width(widths: list[int]) -> int:
    return sum(widths) + BORDER * len(widths) + 1


def column_groups(widths: dict[str, int], names: list[str], width: int) -> list[list[str]]:
    """`widths`' columns split into tables that fit `width`: each holds every column of `names`
    (those naming a row, kept on every table) and as many of the others, in order, as fit (at
    least one)."""
    kept = [k for k in widths if k in names]
    groups: list[list[str]] = [[]]
    for key in (k for k in widths if k not in names):
        trial = groups[-1] + [key]
        if groups[-1] and table_width([widths[k] for k in kept + trial]) > width:
            groups.append([key])
        else:
            groups[-1] = trial
    return [[k for k in widths if k in kept or k in group] for group in groups]   # in the columns' order
