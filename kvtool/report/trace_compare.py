"""Comparing two replays: the run folders of `trace run` (summary.json) or of `trace sweep`
(sweep.json, point by point).

A metric regresses when it moves the wrong way: down for what a cache should raise (hit rate,
hit tokens), up for what it should lower (computed tokens, TTFT). The regression is relative to
A: (B - A) / |A| in the bad direction, 0 when B is as good or better.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtool.errors import InputError
from kvtool.report.sweep_report import capacity_label

HIGHER_IS_BETTER = ("hit_rate", "local_hit_tokens", "connector_hit_tokens", "prefill_compute_saved_s")
LOWER_IS_BETTER = ("computed_tokens", "cancelled_tokens", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ttft_mean_s",
                   "evictions", "connector_evictions", "simulated_seconds", "wall_seconds")
METRICS = HIGHER_IS_BETTER + LOWER_IS_BETTER
DEFAULT_JUDGED = ("hit_rate", "computed_tokens", "ttft_p50_s", "ttft_p99_s")


@dataclass(frozen=True)
class Delta:
    point: str
    """'' for a single run; 'capacity C, T tokens/block' for a sweep point."""
    metric: str
    a: float | None
    b: float | None

    @property
    def change(self) -> float | None:
        """(b - a) / |a|; None when either is missing or a is 0."""
        if self.a is None or self.b is None or self.a == 0:
            return None
        return (self.b - self.a) / abs(self.a)

    @property
    def regression(self) -> float:
        """How much worse b is than a, as a fraction of a (0 when not worse)."""
        change = self.change
        if change is None:
            return 0.0 if self.a == self.b or None in (self.a, self.b) else float("inf")
        return max(-change, 0.0) if self.metric in HIGHER_IS_BETTER else max(change, 0.0)


def compare_folders(a: Path, b: Path) -> list[Delta]:
    """Every metric of both folders, point by point; InputError when they are not two runs of
    the same kind or a sweep point is missing from one."""
    kind_a, kind_b = _kind(a), _kind(b)
    if kind_a != kind_b:
        raise InputError(f"{a} is a {kind_a} folder and {b} a {kind_b} folder: compare two of one kind")
    points_a, points_b = _points(a, kind_a), _points(b, kind_b)
    if set(points_a) != set(points_b):
        missing = sorted(set(points_a) ^ set(points_b))
        raise InputError(f"the sweeps ran different points ({', '.join(missing)} in only one)")
    return [Delta(point, metric, points_a[point].get(metric), points_b[point].get(metric))
            for point in points_a for metric in METRICS
            if points_a[point].get(metric) is not None or points_b[point].get(metric) is not None]


def _kind(folder: Path) -> str:
    if (folder / "summary.json").is_file():
        return "trace run"
    if (folder / "sweep.json").is_file():
        return "trace sweep"
    raise InputError(f"{folder} holds neither summary.json (trace run --output) nor sweep.json (trace sweep --output)")


def _points(folder: Path, kind: str) -> dict[str, dict[str, Any]]:
    name = "summary.json" if kind == "trace run" else "sweep.json"
    try:
        document = json.loads((folder / name).read_text())
        if kind == "trace run":
            ttft = document.get("ttft") or {}
            flat = {f"ttft_{k}_s": v for k, v in (ttft.get("with_connector") or {}).items()}
            return {"": {**document, **flat, "prefill_compute_saved_s": ttft.get("prefill_compute_saved_s")}}
        return {f"capacity {capacity_label(r['capacity_tokens'])}, {r['tokens_per_block']} tokens/block": r
                for r in document["rows"]}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InputError(f"cannot read {folder / name}: {exc}") from None
