"""The run folder every command writes with `--output DIR`: `meta.json` (device, driver, commit,
command, date) beside the command's machine-readable files.

`prepare_run_folder` runs before the work, so a folder that cannot be written fails in a second,
not after an hour of benchmarking.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from kvtool.errors import InputError


def prepare_run_folder(directory: Path) -> Path:
    """Create `directory` (and its parents) and prove it writable; InputError naming why not."""
    if directory.exists() and not directory.is_dir():
        raise InputError(f"--output {directory} is a file; give a folder (it will hold meta.json and the results)")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / ".kvtool-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise InputError(f"cannot write to {directory}: {exc.strerror or exc}") from None
    return directory


def check_writable_file(path: Path, option: str) -> None:
    """InputError now, before any work, when `path` could not be written later."""
    if path.is_dir():
        raise InputError(f"{option} {path} is a folder; give a file name")
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise InputError(f"{option} {path} cannot be written (no write permission in {parent})")


def write_meta(directory: Path, suite: str, **extra: Any) -> dict[str, Any]:
    """`meta.json` in `directory`; returns its device section."""
    device = device_info()
    meta = {"device": device, "commit": git_commit(), "command": sys.argv, "suite": suite,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **extra}
    write_json(directory / "meta.json", meta)
    return device


def write_json(path: Path, document: Any) -> None:
    write_file(path, json.dumps(document, indent=2) + "\n")


def write_file(path: Path, text: str) -> None:
    """`text` into `path` (parents created); InputError naming the path when it cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc.strerror or exc}") from None


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
