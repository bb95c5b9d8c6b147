"""Compiled kernels kept on disk, found again without running nvcc.

PyCUDA's own cache computes its key by running `nvcc --preprocess` and `nvcc --version` in every
process that compiles a module, and validate starts a process for every scenario, a dozen of them
at once on one machine. Here the key is read in-process from what decides the binary: the CUDA
sources of the kernels' folder (`SOURCE_SUFFIXES`, subfolders included: the source and whatever it
includes), the options, the architecture and the nvcc binary's identity (resolved path, size,
modification time). A miss compiles exactly the bytes the key was computed from (copied to a
private folder first: an edit during the compile cannot store one binary under another's key) and
publishes the binary whole (`atomic_file`). Processes that miss together wait for one of them to
compile (a lock file per key) and then read its binary. An entry that is not an ELF file is a miss.

The folder is `$KVTOOL_CACHE_DIR`, else `$XDG_CACHE_HOME/kvtool/cubin` (`~/.cache/kvtool/cubin`);
with no home directory known, nothing is cached (a guessable shared folder could be planted with a
binary this process would run).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from kvtool.atomic_file import publish, temporaries_of

FORMAT = b"kvtool-cubin-2"
"""Part of every key: changing how binaries are built here makes every older entry a miss."""
SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".hpp")
NVCC_TIMEOUT_S = 600
LOCK_WAIT_S = NVCC_TIMEOUT_S
"""How long a process waits for another's compile: no longer than that one's nvcc may run."""
ELF_MAGIC = b"\x7fELF"


def cache_dir() -> Path | None:
    """Where binaries are kept (created on the first write); None: nowhere."""
    if os.environ.get("KVTOOL_CACHE_DIR"):
        return Path(os.environ["KVTOOL_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "kvtool" / "cubin"
    try:
        return Path.home() / ".cache" / "kvtool" / "cubin"
    except RuntimeError:
        return None


def cubin(source: Path, options: Sequence[str], arch: str, fresh: bool = False) -> bytes:
    """`source` compiled by nvcc for `arch` (`sm_90`) with `options`, includes searched in its own
    folder: from the cache when an entry with the same key exists (unless `fresh`: an entry the
    driver refused), else compiled and stored. RuntimeError when nvcc is missing or refuses the
    source, or a source cannot be read (nothing is stored then); a cache folder that cannot be
    written only means the next process compiles again."""
    nvcc = _nvcc()
    sources = _sources(source.parent)
    if source.name not in sources:
        raise RuntimeError(f"no CUDA source {source} (sources end in {', '.join(SOURCE_SUFFIXES)})")
    folder = cache_dir()
    if folder is None:
        return _compile(nvcc, source, sources, options, arch)
    path = folder / f"{_key(source.name, sources, options, arch, nvcc)}.cubin"
    binary = None if fresh else _cached(path)
    if binary is not None:
        return binary
    with _compiling(path):
        binary = None if fresh else _cached(path)     # another process may have compiled it meanwhile
        if binary is None:
            binary = _compile(nvcc, source, sources, options, arch)
            _store(path, binary)
        return binary


def _cached(path: Path) -> bytes | None:
    with contextlib.suppress(OSError):
        binary = path.read_bytes()
        if binary.startswith(ELF_MAGIC):
            return binary
    return None


@contextlib.contextmanager
def _compiling(path: Path):
    """Hold `path`'s compile lock (`NAME.lock` beside it) while the block runs: one process compiles
    a key at a time, and the others find its binary once it is stored. Holding it, the temporaries
    of `path` (`atomic_file.temporaries_of`) can only be what killed writers left: removed
    where this user may. No lock (each process compiles for itself) when the folder cannot be
    written, or after `LOCK_WAIT_S` of waiting (a holder stuck in nvcc)."""
    handle = _lock_handle(path)
    if handle is None or not _locked(handle, time.monotonic() + LOCK_WAIT_S):
        if handle is not None:
            os.close(handle)
        yield
        return
    try:
        for left in temporaries_of(path):
            with contextlib.suppress(OSError):      # another user's, in a shared folder
                left.unlink()
        yield
    finally:
        os.close(handle)         # and with it the lock


def _lock_handle(path: Path) -> int | None:
    """A descriptor of `path`'s lock file, created readable by whoever shares the folder (a lock
    needs no write access); None when it cannot be had."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path.with_name(path.name + ".lock"), os.O_RDONLY | os.O_CREAT, 0o644)
    except OSError:
        return None


def _locked(handle: int, deadline: float) -> bool:
    """Whether the exclusive lock on `handle` was had before `deadline`."""
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def _nvcc() -> Path:
    found = shutil.which("nvcc")
    if found is None:
        raise RuntimeError("nvcc is not on PATH: the CUDA transfer backends compile cuda/ with it")
    return Path(os.path.realpath(found))


def _sources(folder: Path) -> dict[str, bytes]:
    """Every CUDA source under `folder`, by path relative to it."""
    try:
        return {p.relative_to(folder).as_posix(): p.read_bytes()
                for p in sorted(folder.rglob("*")) if p.suffix in SOURCE_SUFFIXES and p.is_file()}
    except OSError as exc:
        raise RuntimeError(f"cannot read the CUDA sources in {folder}: {exc}") from None


def _key(name: str, sources: dict[str, bytes], options: Sequence[str], arch: str, nvcc: Path) -> str:
    stat = nvcc.stat()
    parts = [FORMAT, name.encode(), arch.encode(), *(o.encode() for o in options), str(nvcc).encode(),
             f"{stat.st_size}:{stat.st_mtime_ns}".encode(),
             *(os.environ.get(v, "").encode() for v in ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS"))]
    for relative, data in sources.items():
        parts += [relative.encode(), data]
    digest = hashlib.sha256()
    for part in parts:           # length-prefixed: no two different lists of parts hash alike
        digest.update(len(part).to_bytes(8, "little") + part)
    return digest.hexdigest()


def _compile(nvcc: Path, source: Path, sources: dict[str, bytes], options: Sequence[str], arch: str) -> bytes:
    with tempfile.TemporaryDirectory(prefix="kvtool-nvcc-", ignore_cleanup_errors=True) as work:
        folder = Path(work) / "src"
        for relative, data in sources.items():
            (folder / relative).parent.mkdir(parents=True, exist_ok=True)
            (folder / relative).write_bytes(data)
        out = Path(work) / "kernel.cubin"
        command = [str(nvcc), "--cubin", f"-arch={arch}", *options, f"-I{folder}", "-o", str(out),
                   str(folder / source.name)]
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=work,
                              start_new_session=True) as nvcc_run:
            try:
                stdout, stderr = nvcc_run.communicate(timeout=NVCC_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(nvcc_run.pid, signal.SIGKILL)      # nvcc's compilers too, not only nvcc
                nvcc_run.communicate()
                raise RuntimeError(f"nvcc did not compile {source.name} for {arch} within {NVCC_TIMEOUT_S} s") from None
        if nvcc_run.returncode != 0 or not out.exists():
            # the first error explains the rest; it names the copy, so name the sources instead
            message = (stderr or stdout).strip()[:2000].replace(str(folder), str(source.parent))
            raise RuntimeError(f"nvcc could not compile {source.name} for {arch}: {message}")
        return out.read_bytes()


def _store(path: Path, binary: bytes) -> None:
    with contextlib.suppress(OSError):      # readable by whoever shares the folder
        publish(path, binary, mode=0o644)
