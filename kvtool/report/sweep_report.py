"""Writing a capacity sweep: the terminal table, `sweep.csv`/`sweep.json`, and its plots.

- `hit_rate_vs_capacity.png`: token-weighted hit rate against the tier's capacity (tokens, log
  x), a line per tokens-per-block (not for a connector the sweep does not size: one point per
  tokens-per-block, capacity "its own").
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
from kvtool.units import format_seconds


def sweep_table(frame: pd.DataFrame) -> Table:
    table = Table(title="trace sweep: hit rate against the connector tier's capacity")
    columns = ["capacity (tokens)", "tokens/block", "hit rate", "local hits", "tier hits", "tier evictions"]
    has_ttft = "ttft_p50_s" in frame
    columns += ["TTFT p50", "TTFT p99"] if has_ttft else []
    for column in (*columns, "wall s"):
        table.add_column(column, justify="right")
    for row in frame.to_dict("records"):
        cells = [capacity_label(row["capacity_tokens"]), str(row["tokens_per_block"]), f"{100 * row['hit_rate']:.2f} %",
                 f"{row['local_hit_tokens']:,}", f"{row['connector_hit_tokens']:,}",
                 _count(row["connector_evictions"])]
        if has_ttft:
            cells += [format_seconds(row["ttft_p50_s"]), format_seconds(row["ttft_p99_s"])]
        table.add_row(*cells, f"{row['wall_seconds']:.1f}")
    return table


def write_sweep_folder(folder: Path, frame: pd.DataFrame, extra_meta: dict[str, Any]) -> None:
    write_file(folder / "sweep.csv", frame.to_csv(index=False))
    # pandas turns a missing number into NaN, which is not JSON: write null instead
    rows = [{k: None if isinstance(v, float) and v != v else v for k, v in row.items()}
            for row in frame.to_dict("records")]
    write_json(folder / "sweep.json", {"rows": rows})
    if frame["capacity_tokens"].notna().any():
        plot_hit_rate_vs_capacity(folder / "hit_rate_vs_capacity.png", frame)
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
    for tpb, part in frame.sort_values("capacity_tokens").groupby("tokens_per_block"):
        ax.plot(part["capacity_tokens"], 100 * part["hit_rate"], marker="o", label=f"{tpb} tokens/block")
    ax.set_xscale("log")
    ax.set_xlabel("connector tier capacity (tokens)")
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


def _count(value: Any) -> str:
    return "-" if value is None or value != value else f"{int(value):,}"

