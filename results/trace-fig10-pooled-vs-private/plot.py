"""fig10.png and table.md from the runs' instances.json: fleet hit rate and TTFT against the total
tier capacity, private (a quarter each) against pooled (one shared tier). Run from the repository root."""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
TOTALS = [("128GiB", 128), ("512GiB", 512), ("2TiB", 2048), ("8TiB", 8192)]


def fleet(kind, total):
    return json.loads((HERE / f"{kind}-{total}" / "instances.json").read_text())["all"]


rows = [(gib, fleet("private", name), fleet("pooled", name)) for name, gib in TOTALS]
fig, (hits, ttft) = plt.subplots(2, 1, figsize=(7, 6.5), sharex=True)
x = [gib for gib, _, _ in rows]
for label, index, color in (("4 private tiers, a quarter each", 1, "C0"), ("1 pooled tier (shared Redis)", 2, "C1")):
    hits.plot(x, [100 * r[index]["hit_rate"] for r in rows], marker="o", color=color, label=label)
    ttft.plot(x, [r[index]["ttft_p50_s"] for r in rows], marker="o", color=color, label=f"{label}: p50")
    ttft.plot(x, [r[index]["ttft_p90_s"] for r in rows], marker="s", linestyle="--", color=color, label=f"{label}: p90")
hits.axhline(37.36, color="k", linestyle=":", label="the trace's prefix-reuse bound (37.36 %)")
hits.set_ylabel("fleet hit rate (%)")
hits.set_ylim(0, 40)
hits.legend(fontsize="small", loc="upper left")
ttft.set_ylabel("TTFT (s, cost model)")
ttft.legend(fontsize="x-small", ncol=2)
ttft.set_xscale("log", base=2)
ttft.set_xticks(x, [f"{g} GiB" if g < 1024 else f"{g // 1024} TiB" for g in x])
ttft.minorticks_off()
ttft.set_xlabel("total tier capacity of the fleet (4 engines)")
for ax in (hits, ttft):
    ax.grid(True, alpha=0.3)
fig.suptitle("Private vs pooled KV tiers at equal capacity (Mooncake conversation trace)", fontsize=11)
fig.text(0.01, 0.01, "12,031 requests, prefill only, llama-3.1-8b on 4 x H200 (GPU pool 111.4 GiB each),\n"
         "32 tokens a block, round-robin, LRU; kvtool blocks fidelity; TTFT from kvtool's cost model.", fontsize=7.5)
fig.tight_layout(rect=(0, 0.05, 1, 1))
fig.savefig(HERE / "fig10.png", dpi=150)

lines = ["| total tier | private: hit rate | pooled: hit rate | private: tier hits | pooled: tier hits | "
         "private: TTFT p50 / p90 | pooled: TTFT p50 / p90 |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
for gib, private, pooled in rows:
    lines.append(f"| {gib if gib < 1024 else gib // 1024} {'GiB' if gib < 1024 else 'TiB'} | "
                 f"{100 * private['hit_rate']:.2f} % | {100 * pooled['hit_rate']:.2f} % | "
                 f"{private['connector_hit_tokens'] / 1e6:.2f} M | {pooled['connector_hit_tokens'] / 1e6:.2f} M | "
                 f"{private['ttft_p50_s']:.3f} / {private['ttft_p90_s']:.2f} s | "
                 f"{pooled['ttft_p50_s']:.3f} / {pooled['ttft_p90_s']:.2f} s |")
(HERE / "table.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
