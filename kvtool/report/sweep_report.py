"""Writing a capacity sweep: the terminal table, `sweep.csv`/`sweep.json` (with the study: knee and
recommendation), and its plots.

- `capacity_study.png` (`study_figure`): the figure for a design document, hit rate and TTFT
  against GiB a GPU, the no-tier point and the knee marked, its assumptions in the caption.
- `hit_rate_vs_capacity.png`: token-weighted hit rate against the tier's capacity (GiB a GPU, log
  x, tokens on the top axis), a line per tokens-per-block (not for a connector the sweep does not
  size: one point per tokens-per-block, capacity "its own").
- `hit_rate_vs_tokens_per_block.png` (more than one tokens per block): the hit rate at each
  capacity against tokens per block, and on a second axis the load GB/s the cost model used at
  that size (what `--bandwidth-from` read from a `kvtool bench` run, or the stated default).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
from rich.table import Table

from kvtool.report.run_folder import write_file, write_json, write_meta
from kvtool.report.study_figure import capacity_axis, plot_capacity_study
from kvtool.units import format_seconds


def sweep_tables(frame: pd.DataFrame) -> list[Table]:
    """The points at 80 columns: capacity (GiB a GPU, tokens) and hits; then, with a cost model,
    TTFT, the share within a TTFT objective and the cost a GPU. Counts of 100,000 or more short
    (101k, 6.55M): sweep.csv has them whole."""
    several = frame["tokens_per_block"].nunique() > 1
    title = "trace sweep: hit rate against the tier's capacity a GPU" + \
        ("" if several else f" ({frame['tokens_per_block'].iloc[0]} tokens a block)")
    hits = Table(title=title)
    for column in ("capacity", "tokens", *(["tpb"] if several else []), "hit rate", "local hits", "tier hits",
                   "tier evictions", "wall s"):
        hits.add_column(column, justify="right")
    for row in frame.to_dict("records"):
        tokens = row["capacity_tokens"]
        hits.add_row(_capacity(row), "its own" if tokens is None or tokens != tokens else _short(tokens),
                     *([str(row["tokens_per_block"])] if several else []), f"{100 * row['hit_rate']:.2f} %",
                     _short(row["local_hit_tokens"]), _short(row["connector_hit_tokens"]),
                     _short(row["connector_evictions"]), f"{row['wall_seconds']:.1f}")
    tables = [hits]
    extra = [(key, title) for key, title in (("ttft_p50_s", "TTFT p50"), ("ttft_p90_s", "TTFT p90"),
                                             ("ttft_p99_s", "TTFT p99"), ("slo_attainment", "within SLO"),
                                             ("cost_per_gpu", "cost a GPU")) if key in frame]
    if extra:
        latency = Table(title="TTFT (cost model), objective and cost")
        for column in ("capacity", *(["tpb"] if several else []), *(title for _, title in extra)):
            latency.add_column(column, justify="right")
        for row in frame.to_dict("records"):
            latency.add_row(_capacity(row), *([str(row["tokens_per_block"])] if several else []),
                            *(_extra_cell(key, row.get(key)) for key, _ in extra))
        tables.append(latency)
    return tables


def _capacity(row: dict[str, Any]) -> str:
    label = gib_label(row.get("capacity_bytes"), row["capacity_tokens"])
    return label if label in ("no tier", "its own") else f"{label} GiB"


def _short(value: Any) -> str:
    if value is None or value != value:
        return "-"
    value = int(value)
    if value < 100_000:
        return f"{value:,}"
    return f"{value / 1e3:.0f}k" if value < 1_000_000 else f"{value / 1e6:.3g}M"


def _extra_cell(key: str, value: Any) -> str:
    if value is None or value != value:
        return "-"
    if key == "slo_attainment":
        return f"{100 * value:.1f} %"
    if key == "cost_per_gpu":
        return f"{value:,.2f}"
    return format_seconds(value)


def gib_label(capacity_bytes: Any, capacity_tokens: Any) -> str:
    """A point's capacity in GiB; "no tier" for the baseline, "its own" for an unsized tier."""
    if capacity_tokens == 0:
        return "no tier"
    if capacity_bytes is None or capacity_bytes != capacity_bytes:
        return "its own"
    return f"{capacity_bytes / 2**30:,.3g}" if capacity_bytes < 1000 * 2**30 else f"{capacity_bytes / 2**30:,.0f}"


def write_sweep_folder(folder: Path, frame: pd.DataFrame, extra_meta: dict[str, Any],
                       study: dict[str, Any] | None = None, caption: str = "") -> None:
    """sweep.csv, sweep.json (`rows`, `study`), the plots, meta.json."""
    write_file(folder / "sweep.csv", frame.to_csv(index=False))
    # pandas turns a missing number into NaN, which is not JSON: write null instead
    rows = [{k: None if isinstance(v, float) and v != v else v for k, v in row.items()}
            for row in frame.to_dict("records")]
    write_json(folder / "sweep.json", {"rows": rows, **({"study": study} if study else {})})
    sized = frame[frame["capacity_tokens"].fillna(0) > 0]
    if not sized.empty and "capacity_bytes" in frame and sized["capacity_bytes"].notna().all():
        plot_hit_rate_vs_capacity(folder / "hit_rate_vs_capacity.png", frame)
        plot_capacity_study(folder / "capacity_study.png", frame, study or {}, caption)
    if frame["tokens_per_block"].nunique() > 1:
        plot_hit_rate_vs_tokens_per_block(folder / "hit_rate_vs_tokens_per_block.png", frame)
    write_meta(folder, "trace-sweep", **extra_meta)


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_hit_rate_vs_capacity(path: Path, frame: pd.DataFrame) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    sized = frame[frame["capacity_tokens"].fillna(0) > 0]
    for tpb, part in sized.sort_values("capacity_bytes").groupby("tokens_per_block"):
        ax.plot(part["capacity_bytes"] / 2**30, 100 * part["hit_rate"], marker="o", label=f"{tpb} tokens/block")
    capacity_axis(ax, sized.sort_values("capacity_bytes"))
    ax.set_ylabel("token-weighted hit rate (%)")
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_hit_rate_vs_tokens_per_block(path: Path, frame: pd.DataFrame) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for capacity, part in frame.sort_values("tokens_per_block").groupby("capacity_tokens", dropna=False):
        ax.plot(part["tokens_per_block"], 100 * part["hit_rate"], marker="o", label=capacity_label(capacity, " tokens"))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per block")
    ax.set_ylabel("token-weighted hit rate (%)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small", title="tier capacity", loc="lower left")
    bandwidth = frame.groupby("tokens_per_block")["load_gbps"].first().dropna()
    if not bandwidth.empty:
        other = ax.twinx()
        other.plot(bandwidth.index, bandwidth.values, "k--", marker="s", label="load GB/s")
        other.set_ylabel("load GB/s (kvtool bench, or the stated default)")
        other.set_ylim(bottom=0)
        other.legend(fontsize="small", loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def capacity_label(value: Any, unit: str = "") -> str:
    """A point's tier capacity; "its own" for a connector the sweep does not size (None or NaN)."""
    return "its own" if value is None or value != value else f"{value:.3g}{unit}"
