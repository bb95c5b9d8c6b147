"""Writing a benchmark run: meta.json, results.csv, results.json, a plot, and a rich table."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd
from rich.table import Table

from kvtool.bench.protocol_suite import REFERENCE_MARK
from kvtool.errors import InputError
from kvtool.report.bench_plot import plot
from kvtool.report.fit_table import column_groups
from kvtool.report.run_folder import device_info, write_meta

ROW_KEYS = ("backend", "direction", "granularity", "model", "tokens_per_block", "chunk_bytes", "batch_bytes",
            "gbps", "p50_us", "p99_us", "peak_gbps", "peak_spread", "ratio", "verified")


def default_output_dir() -> Path:
    return Path("results") / datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")


def write_run(directory: Path, rows: list[dict], extra: dict[str, list[dict]], suite: str) -> dict[str, Any]:
    """All outputs of one run under `directory`, meta.json last (it lists them); returns the device
    section."""
    device = device_info()
    try:
        (directory / "results.json").write_text(json.dumps({"device": device, "rows": rows, **extra}, indent=2) + "\n")
        pd.DataFrame(rows).to_csv(directory / "results.csv", index=False)
        for name, more in extra.items():
            pd.DataFrame(more).to_csv(directory / f"{name}.csv", index=False)
    except OSError as exc:
        raise InputError(f"cannot write results to {directory}: {exc.strerror or exc}") from None
    if suite == "transfer" and rows:
        plot(rows, directory / "gbps_vs_chunk.png", device.get("name", ""))
    write_meta(directory, suite, device)
    return device


_SHORT = {"backend": "backend", "direction": "dir", "granularity": "gran", "model": "model",
          "tokens_per_block": "tpb", "chunk_bytes": "chunk", "batch_bytes": "batch", "gbps": "GB/s",
          "p50_us": "p50 µs", "p99_us": "p99 µs", "peak_gbps": "peak GB/s", "peak_spread": "±peak",
          "ratio": "ratio", "verified": "ok", "spread": "±GB/s",
          # --suite store --with-compute
          "matmul_ms_alone": "ms alone", "matmul_ms_during_saves": "ms saving", "matmul_ms_engine_only": "ms engine",
          "slowdown_during_saves": "slowdown saving", "engine_slowdown": "slowdown engine",
          "products_during_saves": "n saving", "products_dropped": "n dropped",
          "save_gbps_with_compute": "save GB/s loaded",
          "save_gbps": "save GB/s alone", "save_ratio_with_compute": "loaded/alone",
          # --suite store
          "block_bytes": "block", "raw_gbps": "raw GB/s", "vs_reference": "vs ref",
          "connector_ms": "conn ms", "runtime_ms": "rt ms",
          # --suite store --with-compute: side by side
          "save_link_share": "save/link", "load_link_share": "load/link", "compute_slowdown": "slowdown"}
LEGEND = ("dir: save (GPU pages -> host store), load (host -> GPU pages), both (at once), gather (GPU pages -> "
          "contiguous GPU); gran: slot (whole pages) or layer (one layer's buffers); tpb: tokens per block; "
          "chunk: bytes per page copy; batch: bytes per timed batch; ratio: GB/s / peak GB/s, where the peak is "
          "one contiguous pinned copy of the same size in the same run; ±peak: (p90 - p10) / median of the "
          "peak's repeats; ok: every byte verified")
_SIZES = {"chunk_bytes", "batch_bytes"}
_TEXT = {"backend", "direction", "granularity", "model", "operation", "connector", "products", "variant", "mode"}


NAMING = ("connector", "backend", "operation", "variant", "direction", "tokens_per_block")
"""Columns that say which row is which: repeated on every table when the rows take several."""
NAME_WIDTH = 24
"""The most a text column takes before it folds (a connector's name folds onto more lines, never cut)."""


def rows_tables(rows: list[dict], title: str, width: int = 150) -> list[Table]:
    """The rows as tables no wider than `width`: one, or several with the naming columns repeated.
    No cell is cut: numbers never wrap, text folds."""
    keys = list(rows[0]) if rows else list(ROW_KEYS)
    cells = [[_cell(k, row[k]) for k in keys] for row in rows]
    widths = {k: max([len(_SHORT.get(k, k))] + [len(_plain(c[i])) for c in cells]) for i, k in enumerate(keys)}
    widths.update({k: min(w, NAME_WIDTH) for k, w in widths.items() if k in _TEXT})
    groups = column_groups(widths, [k for k in keys if k in NAMING], width)
    tables = []
    for n, group in enumerate(groups):
        part = f" ({n + 1} of {len(groups)})" if len(groups) > 1 else ""
        table = Table(title=title + part)
        for key in group:
            text = key in _TEXT
            table.add_column(_SHORT.get(key, key), justify="left" if text else "right", overflow="fold",
                             no_wrap=not text, min_width=widths[key])
        for row in cells:
            table.add_row(*[row[keys.index(k)] for k in group])
        tables.append(table)
    return tables


_MEANING = {"tokens_per_block": "tokens per block", "block_bytes": "bytes of one block", "gbps": "GB/s moved",
            "spread": "(max - min) / median of the rounds' GB/s", "raw_gbps": "the baseline: one contiguous copy "
            "(or the store's raw loop) of the same bytes", "ratio": "GB/s / raw GB/s",
            "vs_reference": "GB/s / kvtool's host connector's GB/s in the same run",
            "verified": "every byte verified",
            "connector_ms": "ms of the round inside the connector (every hook, scheduler and worker: yours to "
            "make faster)", "runtime_ms": "ms of the round in kvtool's runtime (scheduling, manager, the fake "
            "forward and its byte checks)", "p50_us": "median µs per request (per block for a store's own "
            "paths)", "p99_us": "99th percentile µs", "direction": "save (pages -> store) or load (store -> pages)",
            "mode": "the connector's mode option (async and layerwise overlap the forward)",
            "save_link_share": "save GB/s / raw GB/s (the store table's ratio)",
            "load_link_share": "load GB/s / raw GB/s", "compute_slowdown": "the products inside the saves against "
            "beside the engine alone, - 1 (the compute table's slowdown saving)"}


def column_legend(keys: list[str]) -> str:
    """What each shortened header of `keys` means, for the line under a table."""
    return "; ".join(f"{_SHORT.get(k, k)}: {_MEANING[k]}" for k in keys if k in _MEANING)


def rows_table(rows: list[dict], title: str) -> Table:
    """The rows as one table (wide: `rows_tables` fits a console)."""
    return rows_tables(rows, title, width=10**6)[0]


def _plain(cell: str) -> str:
    return re.sub(r"\[/?[a-z ]*\]", "", cell)


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key in _SIZES:
        return _size(int(value))
    if isinstance(value, bool):
        return "yes" if value else "[red]NO[/red]"
    if key == "ratio" and isinstance(value, float) and value > 1:
        return f"[yellow]{value:.3f}![/yellow]"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def _size(num_bytes: int) -> str:
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if num_bytes >= scale and num_bytes % (scale // 16 or 1) == 0:
            return f"{num_bytes / scale:g}{unit}"
    return str(num_bytes)


def bench_notes(rows: list[dict], device_kind: str, skipped_backends: list[str]) -> list[str]:
    """What a reader of the table needs to know about this run: the legend, what a CPU run
    measures, which backends did not run, and rows whose ratio the peak's noise explains."""
    notes = [LEGEND]
    if device_kind == "cpu":
        notes.append("no CUDA GPU here: 'GPU' pages and the host store are both ordinary memory, so these rows "
                     "measure memory copies on this CPU, not a PCIe or NVLink link")
    if skipped_backends:
        notes.append(f"not run here: {', '.join(skipped_backends)} (CUDA backends: they need a CUDA driver and "
                     "pip install 'kvtool[cuda]')")
    fast = [r for r in rows if r.get("ratio", 0) > 1]
    if fast:
        spread = max(r.get("peak_spread", 0.0) for r in fast)
        notes.append(f"{len(fast)} rows (marked !) beat their peak: the peak varied by up to {spread:.0%} between "
                     "repeats; rerun on an idle machine or with more --repeats")
    return notes


@dataclass(frozen=True)
class BenchRate:
    """The row a replay's rate was taken from."""

    gbps: float
    folder: Path
    source: str
    """The row's connector (a store run) or backend (a transfer run)."""
    model: str | None
    tokens_per_block: int

    def describe(self, tokens_per_block: int, model: str | None) -> str:
        """One line: the rate, where it came from, and how that row differs from the replay."""
        mismatches = []
        if self.tokens_per_block != tokens_per_block:
            mismatches.append(f"{self.tokens_per_block} tokens per block, not this replay's {tokens_per_block} "
                              "(the closest the run has)")
        if model is not None and self.model != model:
            mismatches.append(f"model {self.model}, not this replay's {model} (the run has no {model} row)")
        where = f"{self.source}, {self.model}, {self.tokens_per_block} tokens per block"
        text = f"load rate {self.gbps:g} GB/s from {self.folder} ({where})"
        return text + (": " + "; ".join(mismatches) if mismatches else "")

    def as_dict(self) -> dict[str, Any]:
        return {"folder": str(self.folder), "source": self.source, "model": self.model,
                "tokens_per_block": self.tokens_per_block, "gbps": self.gbps}


def bench_rate(directory: Path, direction: str, tokens_per_block: int, model: str | None = None) -> BenchRate:
    """The best GB/s a `kvtool bench` run measured in `direction` at `tokens_per_block` (the
    closest block size it ran when that one is missing), on `model`'s rows when it ran that
    model; of a store run through the engine, the measured connector's rows, never the
    reference's. InputError when the folder has none."""
    path = directory / "results.json"
    try:
        rows = json.loads(path.read_text())["rows"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"--bandwidth-from {directory}: no kvtool bench results.json there ({exc})") from None
    rows = [r for r in rows if isinstance(r, dict) and r.get("direction") == direction and r.get("gbps")
            and REFERENCE_MARK not in str(r.get("connector", ""))]
    if not rows:
        raise InputError(f"--bandwidth-from {directory}: no {direction} rows in results.json")
    rows = [r for r in rows if r.get("model") == model] or rows
    nearest = min({r["tokens_per_block"] for r in rows}, key=lambda t: (abs(t - tokens_per_block), t))
    best = max((r for r in rows if r["tokens_per_block"] == nearest), key=lambda r: float(r["gbps"]))
    return BenchRate(float(best["gbps"]), directory, str(best.get("connector") or best.get("backend") or "?"),
                     best.get("model"), int(nearest))
