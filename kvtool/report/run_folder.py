"""The run folder every command writes with `--output DIR`: `meta.json` (device, driver, commit,
command, date) beside the command's machine-readable files.

`prepare_run_folder` runs before the work, so a folder that cannot be written fails in a second,
not after an hour of benchmarking. A folder reused from an earlier run is cleared of what that run
wrote (`meta.json` lists its files), so no result of it is left beside the new ones; files that
kvtool did not write there are kept.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from kvtool.errors import InputError

OUTPUT_NAMES = frozenset({
    "layout.json", "layout.csv", "summary.json", "summary.csv", "requests.csv", "iterations.csv", "ttft_cdf.png",
    "instances.csv", "instances.json", "sweep.csv", "sweep.json", "hit_rate_vs_capacity.png",
    "hit_rate_vs_tokens_per_block.png", "results.json", "results.csv", "junit.xml", "gbps_vs_chunk.png",
    "compute.csv", "segments.csv", "profile.txt"})
"""Every file a command writes into its run folder: what an earlier run's meta.json that does not
list its files (kvtool before it did) is taken to have written."""

_FOUND: dict[Path, frozenset[str]] = {}
"""Per folder prepared in this process: the names in it before the run (not the run's own)."""
EARLIER_RUN_FOLDER = ".kvtool-earlier-run"
"""Where a run sets an earlier run's files aside: put back if it fails before writing its meta.json,
deleted once it succeeds."""
_SET_ASIDE: list[Path] = []
"""Run folders whose earlier run the running command set aside."""
_CREATED: list[Path] = []
"""Folders the running command created (run folders and their new parents, outermost first): a
command that fails removes those it left empty (`settle_run_folders`)."""


BENCH_SUITES = frozenset({"transfer", "store", "manager", "link-study"})


def command_of(suite: str) -> str:
    """The command that writes a meta.json with this `suite`: bench for its suites, `trace` for
    trace, trace-sweep, trace-instances and trace-replay-bench, the suite itself otherwise."""
    return "bench" if suite in BENCH_SUITES else suite.split("-")[0] if suite.startswith("trace") else suite


def prepare_run_folder(directory: Path, command: str | None = None) -> Path:
    """Create `directory` (and its parents), prove it writable and remove the files an earlier
    kvtool run wrote there (one line on stderr says so); InputError naming why not, and, when
    `command` is given, when the earlier run is another command's (a validate run pointed at a
    bench folder would delete the results a replay is about to read)."""
    if directory.exists() and not directory.is_dir():
        raise InputError(f"--output {directory} is a file; give a folder (it will hold meta.json and the results)")
    earlier = _earlier_run(directory)
    if command is not None and earlier is not None and command_of(earlier["suite"]) != command:
        raise InputError(f"--output {directory} holds a kvtool {command_of(earlier['suite'])} run; a {command} run "
                         "would replace it: give another folder (or remove that one)")
    _CREATED.extend(_missing_folders(directory.resolve()))
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / ".kvtool-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise InputError(f"cannot write to {directory}: {exc.strerror or exc}") from None
    removed = _set_aside_earlier_run(directory, earlier) if earlier is not None else []
    if removed:
        shown = ", ".join(removed[:4]) + (", ..." if len(removed) > 4 else "")
        print(f"kvtool: --output {directory} held an earlier run: replacing its {len(removed)} files ({shown}; "
              "put back if this run fails before writing its results)",
              file=sys.stderr)
    _FOUND[directory.resolve()] = frozenset(p.name for p in directory.iterdir())
    return directory


def _missing_folders(directory: Path) -> list[Path]:
    """`directory` and those of its parents that do not exist yet, outermost first."""
    missing = []
    while not directory.exists() and directory != directory.parent:
        missing.append(directory)
        directory = directory.parent
    return missing[::-1]


def settle_run_folders(failed: bool) -> None:
    """The running command ended. Succeeded: the earlier runs it set aside are deleted. Failed: an
    earlier run it set aside comes back where the command wrote no meta.json of its own (nothing
    already saved is lost to a failure), and the folders it created and left empty are removed,
    innermost first."""
    for directory in _SET_ASIDE:
        aside = directory / EARLIER_RUN_FOLDER
        if failed and not (directory / "meta.json").exists():
            for path in sorted(p for p in aside.rglob("*") if p.is_file() or p.is_symlink()):
                target = directory / path.relative_to(aside)
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, target)
        shutil.rmtree(aside, ignore_errors=True)
    for directory in reversed(_CREATED if failed else []):
        with contextlib.suppress(OSError):
            directory.rmdir()             # only an empty folder: anything written stays
    forget_run_folders()


@contextlib.contextmanager
def settled_run_folders() -> Iterator[None]:
    """Around a command (`cli.common.clean_errors`, the study scripts): its run folders are settled
    as it ends, failed if it raised anything but an exit with code 0 (`SystemExit`, `typer.Exit`)."""
    forget_run_folders()
    try:
        yield
    except BaseException as exc:
        settle_run_folders(failed=not _exits_cleanly(exc))
        raise
    settle_run_folders(failed=False)


def _exits_cleanly(exc: BaseException) -> bool:
    """An exit with code 0: `SystemExit(0)` or `SystemExit()`, or typer's `Exit(0)` (`exit_code`)."""
    if isinstance(exc, SystemExit):
        return exc.code in (0, None)
    return getattr(exc, "exit_code", None) == 0


def forget_run_folders() -> None:
    """A command starts: what an earlier one prepared is not its to settle."""
    _SET_ASIDE.clear()
    _CREATED.clear()


def _earlier_run(directory: Path) -> dict[str, Any] | None:
    """The meta.json of the kvtool run in `directory`; None when there is none or it is not
    kvtool's (no suite, command and date)."""
    try:
        meta = json.loads((directory / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    kvtool_s = isinstance(meta, dict) and {"suite", "command", "date"} <= set(meta) and isinstance(meta["suite"], str)
    return meta if kvtool_s else None


def _set_aside_earlier_run(directory: Path, meta: dict[str, Any]) -> list[str]:
    """The files the run of `meta` (its meta.json in `directory`) wrote, moved into
    `EARLIER_RUN_FOLDER` there (their names); `settle_run_folders` deletes or restores them."""
    listed = meta.get("files")
    names = [n for n in (listed if isinstance(listed, list) else sorted(OUTPUT_NAMES))
             if isinstance(n, str) and n != "meta.json" and _is_inside(n)]
    aside = directory / EARLIER_RUN_FOLDER
    shutil.rmtree(aside, ignore_errors=True)          # a run killed before it settled left one
    removed = []
    for name in [*names, "meta.json"]:
        path = directory.joinpath(*PurePosixPath(name).parts)
        if path.is_symlink() or path.is_file():
            try:
                target = aside.joinpath(*PurePosixPath(name).parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, target)
            except OSError as exc:
                raise InputError(f"cannot move {path}, written by an earlier run: {exc.strerror or exc}") from None
            if directory not in _SET_ASIDE:
                _SET_ASIDE.append(directory)
            removed.append(name)
            for parent in path.parents:      # a folder of the run's (tracebacks/) goes once empty
                if parent == directory or not parent.is_relative_to(directory):
                    break
                try:
                    parent.rmdir()
                except OSError:
                    break
    return removed


def _is_inside(name: str) -> bool:
    """A relative path that stays in its folder (a.csv, tracebacks/x.txt)."""
    path = PurePosixPath(name)
    return bool(path.parts) and not path.is_absolute() and not any(p in ("", ".", "..") for p in path.parts)


def _run_files(directory: Path) -> list[str]:
    """The files of the run in `directory` (relative, / separated): every file but meta.json and
    those `prepare_run_folder` found, and every file under a folder it did not find."""
    found = _FOUND.get(directory.resolve(), frozenset())
    files = []
    for entry in directory.iterdir():
        if entry.name == "meta.json" or entry.name in found:
            continue
        if entry.is_dir() and not entry.is_symlink():
            files += [p.relative_to(directory).as_posix() for p in entry.rglob("*") if p.is_file() or p.is_symlink()]
        elif entry.is_file() or entry.is_symlink():
            files.append(entry.name)
    return sorted(files)


def check_writable_file(path: Path, option: str) -> None:
    """InputError now, before any work, when `path` could not be written later."""
    if path.is_dir():
        raise InputError(f"{option} {path} is a folder; give a file name")
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise InputError(f"{option} {path} cannot be written (no write permission in {parent})")


def write_meta(directory: Path, suite: str, device: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """`meta.json` in `directory`, written last: it lists the run's files (every file there but
    those found by `prepare_run_folder`), which the next run into the folder removes. Returns its
    device section (`device`, or this machine's)."""
    device = device if device is not None else device_info()
    files = _run_files(directory) if directory.is_dir() else []
    meta = {"device": device, "commit": git_commit(), "command": sys.argv, "suite": suite,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "files": files, **extra}
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


def git_commit(where: Path | None = None) -> str | None:
    """HEAD (with -dirty) of this checkout, or of the one at `where`; $KVTOOL_COMMIT where this
    checkout has no .git (the GPU machine)."""
    if where is None and os.environ.get("KVTOOL_COMMIT"):
        return os.environ["KVTOOL_COMMIT"]
    cwd = where if where is not None else Path(__file__).resolve().parent
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=cwd)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10, cwd=cwd).stdout.strip()
        return done.stdout.strip() + ("-dirty" if dirty else "") if done.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None
