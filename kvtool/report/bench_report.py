"""Writing a benchmark run: meta.json, results.csv, results.json, a plot, and a rich table."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from rich.table import Table

from kvtool.errors import InputError

ROW_KEYS = ("backend", "direction", "granularity", "model", "tokens_per_block", "chunk_bytes", "batch_bytes",
            "gbps", "p50_us", "p99_us", "peak_gbps", "ratio", "verified")


def device_info() -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                            "platform": platform.platform(), "cpu": platform.processor() or platform.machine()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info.update(name=props.name, kind="cuda", cuda=torch.version.cuda, sms=props.multi_processor_count,
                    memory_bytes=props.total_memory, driver=_driver_version(), pycuda=_pycuda_version())
    else:
        info.update(name=platform.processor() or platform.machine(), kind="cpu", cuda=None, driver=None,
                    pycuda=_pycuda_version())
    return info


def _driver_version() -> str | None:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
        return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def _pycuda_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("pycuda")
    except PackageNotFoundError:
        return None


def git_commit() -> str | None:
    """HEAD (with -dirty), or $KVTOOL_COMMIT where the checkout has no .git (the GPU machine)."""
    if os.environ.get("KVTOOL_COMMIT"):
        return os.environ["KVTOOL_COMMIT"]
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10, cwd=Path(__file__).resolve().parent).stdout.strip()
        return done.stdout.strip() + ("-dirty" if dirty else "") if done.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def default_output_dir() -> Path:
    return Path("results") / datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")


def write_run(directory: Path, rows: list[dict], extra: dict[str, list[dict]], suite: str) -> dict[str, Any]:
    """All outputs of one run under `directory`; returns the device section."""
    device = device_info()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        meta = {"device": device, "commit": git_commit(), "command": sys.argv, "suite": suite,
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        (directory / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        (directory / "results.json").write_text(json.dumps({"device": device, "rows": rows, **extra}, indent=2) + "\n")
        pd.DataFrame(rows).to_csv(directory / "results.csv", index=False)
        for name, more in extra.items():
            pd.DataFrame(more).to_csv(directory / f"{name}.csv", index=False)
    except OSError as exc:
        raise InputError(f"cannot write results to {directory}: {exc.strerror or exc}") from None
    if suite == "transfer" and rows:
        plot(rows, directory / "gbps_vs_chunk.png", device.get("name", ""))
    return device


def plot(rows: list[dict], path: Path, device_name: str) -> None:
    """GB/s against chunk size per backend, one panel per direction, the measured peak dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    frame = pd.DataFrame(rows)
    directions = list(dict.fromkeys(frame["direction"]))
    fig, axes = plt.subplots(1, len(directions), figsize=(5 * len(directions), 4), squeeze=False)
    for ax, direction in zip(axes[0], directions):
        part = frame[frame["direction"] == direction]
        for backend, group in part.groupby("backend"):
            best = group.groupby("chunk_bytes")["gbps"].max()
            ax.plot(best.index, best.values, marker="o", label=backend)
        peak = part.groupby("chunk_bytes")["peak_gbps"].median()
        ax.plot(peak.index, peak.values, "k--", label="contiguous copy (peak)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("chunk bytes")
        ax.set_ylabel("GB/s")
        ax.set_title(direction)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"kvtool bench · {device_name}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


_SHORT = {"backend": "backend", "direction": "dir", "granularity": "gran", "model": "model",
          "tokens_per_block": "tpb", "chunk_bytes": "chunk", "batch_bytes": "batch", "gbps": "GB/s",
          "p50_us": "p50 µs", "p99_us": "p99 µs", "peak_gbps": "peak GB/s", "ratio": "ratio", "verified": "ok"}
_SIZES = {"chunk_bytes", "batch_bytes"}
_TEXT = {"backend", "direction", "granularity", "model", "operation"}


def rows_table(rows: list[dict], title: str) -> Table:
    table = Table(title=title)
    keys = list(rows[0]) if rows else list(ROW_KEYS)
    for key in keys:
        table.add_column(_SHORT.get(key, key), justify="left" if key in _TEXT else "right")
    for row in rows:
        table.add_row(*[_cell(k, row[k]) for k in keys])
    return table


def _cell(key: str, value: Any) -> str:
    if key in _SIZES:
        return _size(int(value))
    if isinstance(value, bool):
        return "yes" if value else "[red]NO[/red]"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def _size(num_bytes: int) -> str:
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if num_bytes >= scale and num_bytes % (scale // 16 or 1) == 0:
            return f"{num_bytes / scale:g}{unit}"
    return str(num_bytes)
