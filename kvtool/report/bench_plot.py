"""`gbps_vs_chunk.png`: a transfer run's GB/s against chunk size.

One panel per (model, granularity) and direction: a model and a granularity fix the layout, so
only inside one panel do the points of a backend lie on one curve (its tokens-per-block sizes,
each a chunk size). Each panel holds one line per backend and the peak of its own workspaces
(the contiguous copy measured beside those rows), dashed; a backend keeps its colour in every
panel, and one legend for the figure names them.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

PEAK_LABEL = "contiguous copy (peak)"


def plot(rows: list[dict], path: Path, device_name: str) -> None:
    """Draw `figure(rows, device_name)` into `path`."""
    import matplotlib.pyplot as plt
    fig = figure(rows, device_name)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def figure(rows: list[dict], device_name: str):
    """The figure: a row of panels per (model, granularity), a column per direction, y shared
    along a column so that models and granularities compare at a glance."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    frame = pd.DataFrame(rows)
    directions = list(dict.fromkeys(frame["direction"]))
    layouts = list(dict.fromkeys(zip(frame["model"], frame["granularity"], strict=True)))
    colours = _colours(frame["backend"])
    labels = [*colours, PEAK_LABEL]
    width = max(4.4 * len(directions), 8.0)
    num_legend_columns = _legend_columns(labels, width)
    top = 0.4 + 0.25 * math.ceil(len(labels) / num_legend_columns)      # inches above the panels
    fig, axes = plt.subplots(len(layouts), len(directions), squeeze=False, sharey="col",
                             figsize=(width, 3.2 * len(layouts) + top))
    for row, (model, granularity) in enumerate(layouts):
        for column, direction in enumerate(directions):
            part = frame[(frame["model"] == model) & (frame["granularity"] == granularity)
                         & (frame["direction"] == direction)]
            _panel(axes[row][column], part, colours, f"{direction} · {model} · {granularity}")
    handles = {line.get_label(): line for ax in axes.flat for line in ax.get_lines()}
    labels = [label for label in labels if label in handles]
    inch = 1 / fig.get_figheight()
    fig.suptitle(f"kvtool bench · {device_name} · best GB/s per chunk size", y=1 - 0.1 * inch, va="top")
    fig.legend([handles[label] for label in labels], labels, loc="upper center", ncol=num_legend_columns,
               bbox_to_anchor=(0.5, 1 - 0.4 * inch), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - top * inch))
    return fig


def _panel(ax, part: pd.DataFrame, colours: dict[str, str], title: str) -> None:
    """One (model, granularity, direction): a line per backend, the peak dashed, the chunk sizes
    as ticks labelled with their tokens per block."""
    from matplotlib.ticker import FuncFormatter, NullLocator
    ax.set_title(title, fontsize="medium")
    if part.empty:
        ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks([])
        return
    for backend, group in part.groupby("backend"):
        best = group.groupby("chunk_bytes")["gbps"].max()
        ax.plot(best.index, best.values, marker="o", color=colours[backend], label=backend)
    peak = part.groupby("chunk_bytes")["peak_gbps"].median()
    ax.plot(peak.index, peak.values, "k--", marker="_", markersize=16, label=PEAK_LABEL)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = part.groupby("chunk_bytes")["tokens_per_block"].first()
    ax.set_xticks(list(ticks.index), [f"{_size(c)}\ntpb {t}" for c, t in ticks.items()])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(_gbps))
    ax.yaxis.set_minor_formatter(FuncFormatter(_gbps_2_5))
    ax.set_xlim(min(ticks.index) / 1.6, max(ticks.index) * 1.6)
    ax.set_xlabel("chunk bytes")
    ax.set_ylabel("GB/s")
    ax.grid(True, which="both", alpha=0.3)


def _legend_columns(labels: list[str], width: float) -> int:
    """The most legend columns whose widest row fits in `width` inches (an entry: its line and
    about 0.09 inch a character)."""
    entries = [0.7 + 0.09 * len(label) for label in labels]
    for num_columns in range(len(labels), 1, -1):
        rows = [entries[i:i + num_columns] for i in range(0, len(entries), num_columns)]
        column_widths = [max(row[c] for row in rows if c < len(row)) for c in range(num_columns)]
        if sum(column_widths) <= width - 0.5:
            return num_columns
    return 1


def _colours(backends: pd.Series) -> dict[str, str]:
    """A colour per backend, the same in every panel."""
    names = sorted(set(backends))
    return {name: f"C{i % 10}" for i, name in enumerate(names)}


def _gbps(value: float, _position) -> str:
    return f"{value:g}"


def _gbps_2_5(value: float, _position) -> str:
    """A minor tick's label at 2 and 5 times a power of ten only: a panel may span decades."""
    mantissa = value / 10 ** math.floor(math.log10(value))
    return f"{value:g}" if round(mantissa) in (2, 5) else ""


def _size(num_bytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.3g} {unit}"
    return f"{num_bytes} B"
