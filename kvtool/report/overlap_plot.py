"""`overlap.png` (`bench --suite store --with-compute --plot`): the link share and the compute
slowdown of each connector against block size, two panels side by side (matplotlib, already a
dependency of the transfer suite's plot).

Left: save (solid) and load (dashed) GB/s over the link measured in the same run, a line pair per
connector; right: how much slower the products ran inside the saves, in percent. The goals of
issue 56 (0.9 of the link, 2 % slower) are drawn as grey lines, so a point on the wrong side of
one is seen at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

LINK_GOAL = 0.9
SLOWDOWN_GOAL_PERCENT = 2.0


def plot_overlap(rows: Sequence[dict], path: Path, device_name: str) -> None:
    """Draw `overlap_figure(rows, device_name)` into `path` (a PNG)."""
    import matplotlib.pyplot as plt
    fig = overlap_figure(rows, device_name)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def overlap_figure(rows: Sequence[dict], device_name: str):
    """Rows of `overlap.OverlapRow.as_dict()`; x: block bytes (the tokens per block beside each)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (share, slow) = plt.subplots(1, 2, figsize=(11, 4.2))
    for index, label in enumerate(dict.fromkeys(r["connector"] for r in rows)):
        mine = sorted((r for r in rows if r["connector"] == label), key=lambda r: r["block_bytes"])
        colour = f"C{index}"
        name = f"{label} ({mine[0]['mode']})" if mine[0]["mode"] else label
        x = [r["block_bytes"] / 2**20 for r in mine]
        share.plot(x, [r["save_link_share"] for r in mine], "o-", color=colour, label=f"{name} save")
        share.plot(x, [r["load_link_share"] for r in mine], "s--", color=colour, label=f"{name} load")
        points = [(xi, r["compute_slowdown"] * 100) for xi, r in zip(x, mine, strict=True)
                  if r["compute_slowdown"] is not None]
        slow.plot([p[0] for p in points], [p[1] for p in points], "o-", color=colour, label=name)
    share.axhline(LINK_GOAL, color="grey", lw=0.8, ls=":")
    slow.axhline(SLOWDOWN_GOAL_PERCENT, color="grey", lw=0.8, ls=":")
    ticks = sorted({(r["block_bytes"] / 2**20, r["tokens_per_block"]) for r in rows})
    for ax, title, ylabel in ((share, "link share", "GB/s / link GB/s"),
                              (slow, "compute slowdown while saving", "% slower")):
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.set_xscale("log", base=2)
        ax.set_xticks([t[0] for t in ticks], [f"{t[0]:g} MiB\n{t[1]} tpb" for t in ticks])
        ax.set_xlabel("block size")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"kvtool bench --suite store · {device_name} · link share and compute slowdown")
    fig.tight_layout()
    return fig
