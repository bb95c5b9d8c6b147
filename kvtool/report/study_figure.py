"""The capacity study's figure, fit to paste into a design document: hit rate (top) and TTFT p50
and p99 (bottom) against the tier's GiB a GPU, one tick per swept capacity (GiB below, tokens on
the top axis), the no-tier point as dashed lines, the knee and a TTFT objective marked, and what
was assumed in the caption under the plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

MAX_TICK_LABELS = 8


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def tokens_label(tokens: float) -> str:
    """131k, 1.05M, 12.6M: a tick's tokens, short."""
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if tokens >= scale:
            return f"{tokens / scale:.3g}{unit}"
    return f"{tokens:.0f}"


def gib_tick(gib: float) -> str:
    return f"{gib:.3g} GiB" if gib < 1000 else f"{gib / 1024:.3g} TiB"


def capacity_axis(ax, sized: pd.DataFrame, tokens_on_top: bool = True) -> None:
    """A log-2 x axis with a tick at each swept capacity, in GiB, and its tokens on a top axis; at
    most MAX_TICK_LABELS labels (every other one beyond)."""
    from matplotlib.ticker import FixedFormatter, FixedLocator, NullLocator

    points = sized.drop_duplicates("capacity_bytes")
    gib = list(points["capacity_bytes"] / 2**30)
    step = max(1, -(-len(gib) // MAX_TICK_LABELS))
    labels = [gib_tick(g) if i % step == 0 else "" for i, g in enumerate(gib)]
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(gib))
    ax.xaxis.set_major_formatter(FixedFormatter(labels))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("tier capacity a GPU")
    if not tokens_on_top:
        return
    top = ax.secondary_xaxis("top")
    top.xaxis.set_major_locator(FixedLocator(gib))
    top.xaxis.set_major_formatter(FixedFormatter(
        [tokens_label(t) if i % step == 0 else "" for i, t in enumerate(points["capacity_tokens"])]))
    top.xaxis.set_minor_locator(NullLocator())
    top.set_xlabel("tokens")


def plot_capacity_study(path: Path, frame: pd.DataFrame, study: dict[str, Any], caption: str) -> None:
    """The figure of the smallest tokens per block swept (the knee's, if any)."""
    plt = _pyplot()
    tpb = int(frame["tokens_per_block"].min())
    mine = frame[frame["tokens_per_block"] == tpb]
    sized = mine[mine["capacity_tokens"].fillna(0) > 0].sort_values("capacity_bytes")
    base = mine[mine["capacity_tokens"] == 0]
    has_ttft = "ttft_p50_s" in mine and sized["ttft_p50_s"].notna().any()
    fig, axes = plt.subplots(2 if has_ttft else 1, 1, figsize=(7.5, 7 if has_ttft else 4.4), sharex=True,
                             squeeze=False)
    gib = sized["capacity_bytes"] / 2**30
    part = study.get("tokens_per_block", {}).get(str(tpb), {})
    _hit_rate_panel(axes[0][0], gib, sized, base, part.get("knee"))
    if has_ttft:
        _ttft_panel(axes[1][0], gib, sized, base, study.get("ttft_slo_s"))
    for i, ax in enumerate(row[0] for row in axes):
        capacity_axis(ax, sized, tokens_on_top=i == 0)
        ax.grid(True, which="major", alpha=0.3)
    for ax in (row[0] for row in axes[:-1]):
        ax.set_xlabel("")
    fig.suptitle(f"KV tier capacity study ({tpb} tokens a block)", fontsize=12)
    lines = caption.count("\n") + 1
    fig.tight_layout(rect=(0, 0.035 * lines + 0.02, 1, 1))
    fig.text(0.01, 0.01, caption, fontsize=7.5, va="bottom", ha="left", wrap=True)
    fig.savefig(path, dpi=150)
    plt.close(fig)


def _hit_rate_panel(ax, gib: pd.Series, sized: pd.DataFrame, base: pd.DataFrame, knee: dict | None) -> None:
    ax.plot(gib, 100 * sized["hit_rate"], marker="o", color="C0", label="with the tier")
    if not base.empty:
        ax.axhline(100 * base["hit_rate"].iloc[0], color="C0", linestyle="--", alpha=0.7,
                   label=f"no tier ({100 * base['hit_rate'].iloc[0]:.1f} %)")
    if knee:
        at = knee["capacity_bytes"] / 2**30
        ax.axvline(at, color="C3", linestyle=":", label=f"95 % of the gain: {gib_tick(at)}")
    ax.set_ylabel("token-weighted hit rate (%)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small", loc="lower right")


def _ttft_panel(ax, gib: pd.Series, sized: pd.DataFrame, base: pd.DataFrame, slo: float | None) -> None:
    for key, label, color in (("ttft_p50_s", "TTFT p50", "C1"), ("ttft_p99_s", "TTFT p99", "C2")):
        ax.plot(gib, sized[key], marker="o", color=color, label=label)
        if not base.empty and base[key].notna().all():
            ax.axhline(base[key].iloc[0], color=color, linestyle="--", alpha=0.7, label=f"{label}, no tier")
    if slo is not None:
        ax.axhline(slo, color="k", linestyle="-.", linewidth=1, label=f"objective {slo:g} s")
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: seconds_tick(v)))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylabel("TTFT (cost model)")
    ax.legend(fontsize="small", loc="best", ncol=2)


def seconds_tick(value: float) -> str:
    """20 s, 2 s, 500 ms, 50 ms: a TTFT tick."""
    return f"{value:g} s" if value >= 1 else f"{value * 1e3:g} ms"
