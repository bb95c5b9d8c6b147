"""Writing a replay: the per-tier table, TTFT percentiles, and the run folder (summary, a row per
request and per iteration, the TTFT CDF plot, meta.json with every cost-model assumption)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from rich.table import Table

from kvtool.report.run_folder import write_file, write_json, write_meta
from kvtool.trace.cost_model import CostModel
from kvtool.trace.load_check import load_check
from kvtool.trace.recorder import RequestRow
from kvtool.trace.replay import TraceResult, TraceSummary
from kvtool.units import format_seconds, format_size

PERCENTILES = (50, 90, 99)


def tier_table(summary: TraceSummary, title: str = "") -> Table:
    """Where the prompt tokens came from, per tier, and what each tier moved and dropped."""
    table = Table(title=title or f"trace: {summary.model} · connector {summary.connector} · {summary.fidelity}")
    for column in ("tier", "prompt tokens", "share", "blocks", "bytes", "evictions"):
        table.add_column(column, justify="left" if column == "tier" else "right")
    total = max(summary.prompt_tokens, 1)

    def share(n: int) -> str:
        return f"{100 * n / total:.1f} %"

    table.add_row("local (GPU radix tree)", f"{summary.local_hit_tokens:,}", share(summary.local_hit_tokens), "",
                  "", f"{summary.evictions:,}")
    loaded = "-" if summary.loaded_blocks is None else f"{summary.loaded_blocks:,} loaded"
    moved = "-" if summary.bytes_loaded is None else f"{format_size(summary.bytes_loaded)} in"
    table.add_row(f"connector ({summary.connector})", f"{summary.connector_hit_tokens:,}",
                  share(summary.connector_hit_tokens), loaded, moved,
                  "-" if summary.connector_evictions is None else f"{summary.connector_evictions:,}")
    for tier, tokens in (summary.tier_hit_tokens or {}).items():
        table.add_row(f"  {tier} tier", f"{tokens:,}", share(tokens), "", "", "")
    if summary.saved_blocks is not None:
        table.add_row("  saved", "", "", f"{summary.saved_blocks:,} saved",
                      "-" if summary.bytes_saved is None else f"{format_size(summary.bytes_saved)} out", "")
    computed = summary.prompt_tokens - summary.local_hit_tokens - summary.connector_hit_tokens
    table.add_row("computed (prompt only)", f"{computed:,}", share(computed), "", "", "")
    table.add_row("cancelled (offered, not taken)", f"{summary.cancelled_tokens:,}", "", "", "", "")
    table.add_row("[bold]hit rate[/bold]", "", f"[bold]{100 * summary.hit_rate:.2f} %[/bold]", "", "", "")
    return table


def ttft_stats(rows: list[RequestRow], metric: str = "ttft") -> dict[str, float | None]:
    """p50/p90/p99 and mean TTFT (or `metric`: tpot) in seconds over the requests that have one."""
    values = np.array([getattr(r, metric) for r in rows if getattr(r, metric) is not None])
    stats: dict[str, float | None] = {}
    for p in PERCENTILES:
        stats[f"p{p}"] = float(np.percentile(values, p)) if values.size else None
    stats["mean"] = float(values.mean()) if values.size else None
    return stats


def compute_saved_seconds(rows: list[RequestRow], cost: CostModel) -> float:
    """Prefill compute the caches spared: each request's prompt computed from its hit length on,
    instead of from 0."""
    return sum(cost.compute_seconds(0, r.prompt_len) - cost.compute_seconds(r.prompt_len - r.computed_prompt_tokens,
                                                                           r.prompt_len) for r in rows)


def ttft_report(result: TraceResult, cost: CostModel | None, baseline: TraceResult | None) -> dict[str, Any]:
    """TTFT and compute saved for the run (and the run without the connector, when given)."""
    if cost is None:
        return {}
    report = {"with_connector": ttft_stats(result.recorder.requests),
              "prefill_compute_saved_s": compute_saved_seconds(result.recorder.requests, cost),
              "tpot": ttft_stats(result.recorder.requests, "tpot")}
    check = load_check(result.recorder.requests)
    if check is not None:
        report["load"] = {**check.as_dict(), "note": check.note()}
    if baseline is not None:
        report["without_connector"] = ttft_stats(baseline.recorder.requests)
        report["prefill_compute_saved_without_connector_s"] = compute_saved_seconds(baseline.recorder.requests, cost)
    return report


def run_label(connector: str) -> str:
    """How a replay is named in the TTFT table and plot: by its connector."""
    return "no connector" if connector in ("", "none") else f"connector {connector}"


def ttft_table(report: dict[str, Any], connector: str) -> Table:
    """TTFT percentiles of the run with `connector` (and of the run without it, when in `report`)."""
    table = Table(title="TTFT (cost model)")
    table.add_column("run")
    for column in (*(f"p{p}" for p in PERCENTILES), "mean", "prefill compute saved"):
        table.add_column(column, justify="right")
    for key, label in (("with_connector", run_label(connector)), ("without_connector", "without the connector")):
        if key in report:
            stats = report[key]
            saved = report["prefill_compute_saved_s" if key == "with_connector"
                            else "prefill_compute_saved_without_connector_s"]
            table.add_row(label, *(format_seconds(stats[k]) for k in (*(f"p{p}" for p in PERCENTILES), "mean")),
                          f"{saved:,.1f} s")
    return table


def cost_model_text(assumptions: dict[str, Any]) -> str:
    """The cost model's assumptions (`CostModel.assumptions()`) as one sentence; a field this does
    not know is appended as `name=value`."""
    a = dict(assumptions)
    phrases = (("active_params", lambda v: f"{v:,.3g} active parameters"), ("num_layers", lambda v: f"{v} layers"),
               ("attention_width", lambda v: f"attention width {v}"), ("hidden", lambda v: f"hidden {v}"),
               ("kv_bytes_per_token", lambda v: f"{format_size(v)} of KV a token"),
               ("weight_bytes", lambda v: f"{format_size(v)} of weights"),
               ("gpu", lambda v: f"on {a.pop('tp', 1)} x {v}"),
               ("tflops", lambda v: f"compute at {v:g} TFLOP/s"), ("hbm_gbps", lambda v: f"HBM reads at {v:g} GB/s"),
               ("nvlink_gbps", lambda v: f"all-reduces at {v:g} GB/s + {a.pop('allreduce_us', 0):g} us"),
               ("load_gbps", lambda v: f"connector loads at {v:g} GB/s"
                + (" overlapped layer by layer" if a.pop("layerwise", False) else " before the pass")),
               ("tier_gbps", lambda v: "tiers " + ", ".join(f"{k} {g:g} GB/s" for k, g in v.items())),
               ("idle_seconds", lambda v: f"{format_seconds(v)} an idle iteration"))
    parts = [describe(a.pop(key)) for key, describe in phrases if key in a]
    parts += [f"{k}={v}" for k, v in a.items()]
    return "cost model: " + ", ".join(parts)


def write_trace_folder(folder: Path, result: TraceResult, cost: CostModel | None, ttft: dict[str, Any],
                       baseline: TraceResult | None, extra_meta: dict[str, Any]) -> None:
    """summary.json/.csv, requests.csv, iterations.csv, ttft_cdf.png (with a cost model), meta.json."""
    document = {**result.summary.as_dict(), "ttft": ttft}
    write_json(folder / "summary.json", document)
    write_file(folder / "summary.csv", pd.DataFrame([result.summary.as_dict()]).to_csv(index=False))
    write_file(folder / "requests.csv",
               pd.DataFrame([r.as_dict() for r in result.recorder.requests]).to_csv(index=False))
    write_file(folder / "iterations.csv",
               pd.DataFrame([vars(r) for r in result.recorder.iterations]).to_csv(index=False))
    if cost is not None:
        plot_ttft_cdf(folder / "ttft_cdf.png", {run_label(result.summary.connector): result.recorder.requests} |
                      ({"without the connector": baseline.recorder.requests} if baseline else {}))
    write_meta(folder, "trace", cost_model=cost.assumptions() if cost else None, **extra_meta)


def plot_ttft_cdf(path: Path, runs: dict[str, list[RequestRow]]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, rows in runs.items():
        values = np.sort([r.ttft for r in rows if r.ttft is not None])
        if values.size:
            ax.plot(values, np.arange(1, values.size + 1) / values.size, label=label)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, cost model)")
    ax.set_ylabel("fraction of requests")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
