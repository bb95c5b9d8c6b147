"""What a capacity sweep recommends: the knee of the hit-rate curve, what it costs, whether TTFT
meets an SLO there, in one line a design document can quote.

The knee is the smallest swept capacity whose hit rate reaches `KNEE_FRACTION` of the plateau's
gain over the no-tier point (a sweep's `--baseline`; without it the gain is counted from 0):

    hit rate >= no tier + 0.95 x (plateau - no tier),    plateau = the best hit rate swept

(the gain, not the hit rate: where the GPU alone already reaches most of the plateau, 95 % of the
hit rate says nothing). Capacities are a GPU's (one engine's tier, or a tensor-parallel rank's
shard of it). No interpolation: the knee is a swept point, and the line says which point below it
was swept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvtool.engine.ranks import rank_manager_config
from kvtool.manager.manager import compute_layout
from kvtool.trace.setup import Replay, ReplayOptions
from kvtool.units import format_gib

KNEE_FRACTION = 0.95


@dataclass(frozen=True)
class Knee:
    capacity_bytes: int
    capacity_tokens: int
    hit_rate: float
    plateau: float
    no_tier: float
    below_bytes: int | None
    """The swept capacity below the knee (None: the knee is the smallest swept)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def knee(rows: Sequence[dict[str, Any]], fraction: float = KNEE_FRACTION) -> Knee | None:
    """The knee of one tokens-per-block's rows (a row each capacity; `capacity_tokens` 0: the
    no-tier point); None without sized points or with no gain over the no-tier point."""
    sized = sorted((r for r in rows if r.get("capacity_tokens")), key=lambda r: r["capacity_tokens"])
    if not sized or sized[0].get("capacity_bytes") is None:
        return None
    no_tier = next((r["hit_rate"] for r in rows if r.get("capacity_tokens") == 0), 0.0)
    plateau = max(r["hit_rate"] for r in sized)
    if plateau <= no_tier:
        return None
    target = no_tier + fraction * (plateau - no_tier)
    at = next(i for i, r in enumerate(sized) if r["hit_rate"] >= target - 1e-12)
    return Knee(int(sized[at]["capacity_bytes"]), int(sized[at]["capacity_tokens"]), sized[at]["hit_rate"], plateau,
                no_tier, int(sized[at - 1]["capacity_bytes"]) if at else None)


def point_at(rows: Sequence[dict[str, Any]], capacity_tokens: int) -> dict[str, Any] | None:
    return next((r for r in rows if r.get("capacity_tokens") == capacity_tokens), None)


def recommendation(rows: Sequence[dict[str, Any]], price_per_gib: float | None = None,
                   ttft_slo: float | None = None) -> str | None:
    """The line: the knee, its hit rate against the plateau and no tier, its TTFT against no tier,
    its price, its SLO attainment; None when there is no knee."""
    found = knee(rows)
    if found is None:
        return None
    at = point_at(rows, found.capacity_tokens) or {}
    base = point_at(rows, 0)
    against = f"{100 * found.no_tier:.2f} % without a tier" if base is not None else \
        "no --baseline: the gain counted from 0"
    parts = [f"{KNEE_FRACTION:.0%} of the plateau's gain at {format_gib(found.capacity_bytes)} a GPU "
             f"({found.capacity_tokens:,} tokens): hit rate {100 * found.hit_rate:.2f} % of the plateau's "
             f"{100 * found.plateau:.2f} % ({against})"]
    if found.below_bytes is not None:
        parts[0] += f"; {format_gib(found.below_bytes)} was short of it"
    if at.get("ttft_p50_s") is not None:
        ttft = f"TTFT p50 {_seconds(at['ttft_p50_s'])}, p99 {_seconds(at['ttft_p99_s'])}"
        if base is not None and base.get("ttft_p50_s") is not None:
            ttft += f" (no tier: {_seconds(base['ttft_p50_s'])}, {_seconds(base['ttft_p99_s'])})"
        parts.append(ttft)
    if ttft_slo is not None and at.get("slo_attainment") is not None:
        parts.append(f"{100 * at['slo_attainment']:.1f} % of requests within the {ttft_slo:g} s TTFT SLO"
                     + (f" (no tier: {100 * base['slo_attainment']:.1f} %)" if base is not None else ""))
    if price_per_gib is not None:
        parts.append(f"{price_per_gib * found.capacity_bytes / 2**30:,.2f} a GPU at {price_per_gib:g} a GiB")
    return "recommendation: " + "; ".join(parts)


def slo_attainment(ttfts: Sequence[float | None], slo: float) -> float | None:
    """The fraction of requests whose first token came within `slo` seconds (None: no TTFT)."""
    timed = [t for t in ttfts if t is not None]
    return sum(t <= slo for t in timed) / len(timed) if timed else None


def _seconds(value: float) -> str:
    return f"{value * 1e3:.0f} ms" if value < 1 else f"{value:.2f} s"


def with_cost(row: dict[str, Any], price_per_gib: float | None) -> dict[str, Any]:
    """`row` with `cost_per_gpu` (its tier's GiB x the price) when a price is given."""
    if price_per_gib is None or row.get("capacity_bytes") is None:
        return row
    return {**row, "cost_per_gpu": round(price_per_gib * row["capacity_bytes"] / 2**30, 6)}


def sweep_study(rows: list[dict[str, Any]], price_per_gib: float | None,
                ttft_slo: float | None) -> dict[str, Any]:
    """Per tokens per block: the knee and the recommendation line (`kvtool.trace.study`)."""
    study = {}
    for tpb in sorted({r["tokens_per_block"] for r in rows}):
        mine = [r for r in rows if r["tokens_per_block"] == tpb]
        found = knee(mine)
        study[str(tpb)] = {"knee": found.as_dict() if found else None,
                           "recommendation": recommendation(mine, price_per_gib, ttft_slo)}
    return {"tokens_per_block": study, "price_per_gib": price_per_gib, "ttft_slo_s": ttft_slo}


def sweep_meta(replay: Replay) -> dict[str, Any]:
    """meta.json's keys of a sweep's last point: its cost model and GPU pool."""
    return {**({"cost_model": replay.cost_model.assumptions()} if replay.cost_model else {}),
            **({"gpu_pool": replay.gpu_pool.as_dict()} if replay.gpu_pool else {})}


def study_caption(replay: Replay, options: ReplayOptions, ttft_slo: float | None) -> str:
    """The figure's caption: what was replayed, on what, and how TTFT was priced."""
    manager = replay.config.manager
    cost = replay.cost_model
    gpu = f"{cost.tp} x {cost.gpu.name}" if cost else "no cost model"
    pool = rank_manager_config(manager, replay.config.tp_size, 0)
    pool_bytes = sum(pg.slot_bytes * pg.num_slots for pg in compute_layout(pool).pool_groups)
    eviction = replay.options.get("eviction", "lru")
    lines = [f"{Path(options.workload).name}: {replay.workload.count():,} requests; {manager.model.name} on {gpu}; "
             f"GPU pool {format_gib(pool_bytes)} a GPU; {manager.tokens_per_block} tokens a block; tier "
             f"{options.connector} ({eviction}), capacity a GPU."]
    if cost is not None:
        lines.append("TTFT from kvtool's cost model (prefill at the GPU's FLOP/s, decode at its HBM rate), a "
                     "lower bound: 24-36 % fast against vLLM's published latencies (docs/trace-replay.md).")
    if ttft_slo is not None:
        lines.append(f"Dash-dotted: the {ttft_slo:g} s TTFT objective; dashed: the replay without the tier.")
    return "\n".join(lines)
