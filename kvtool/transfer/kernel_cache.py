"""Compiled kernels kept on disk, found again without running nvcc.

PyCUDA's own cache computes its key by running `nvcc --preprocess` and `nvcc --version` in every
process that compiles a module, and validate starts a process for every scenario, a dozen of them
at once on one machine. Here the key is read in-process from what decides the binary: every file of
the kernels' folder (the source and what it includes), the options, the architecture and the nvcc
binary's identity (resolved path, size, modification time). A miss runs nvcc once and renames the
binary into place, so a reader never sees half a file; processes that miss together each compile
the same bytes and the last rename wins.

The folder is `$KVTOOL_CACHE_DIR`, else `$XDG_CACHE_HOME/kvtool/cubin` (`~/.cache/kvtool/cubin`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Sequence

FORMAT = b"kvtool-cubin-1"
"""Part of every key: changing how binaries are built here makes every older entry a miss."""


def cache_dir() -> Path:
    """Where binaries are kept (created on the first write)."""
    if os.environ.get("KVTOOL_CACHE_DIR"):
        return Path(os.environ["KVTOOL_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvtool" / "cubin"


def cubin(source: Path, options: Sequence[str], arch: str) -> bytes:
    """`source` compiled by nvcc for `arch` (`sm_90`) with `options`, includes searched in its own
    folder: from the cache when an entry with the same key exists, else compiled and stored.
    RuntimeError when nvcc is missing or refuses the source (nothing is stored then); a cache
    folder that cannot be written only means the next process compiles again."""
    nvcc = _nvcc()
    path = cache_dir() / f"{_key(source, options, arch, nvcc)}.cubin"
    try:
        return path.read_bytes()
    except OSError:
        pass
    binary = _compile(nvcc, source, options, arch)
    _store(path, binary)
    return binary


def _nvcc() -> Path:
    found = shutil.which("nvcc")
    if found is None:
        raise RuntimeError("nvcc is not on PATH: the CUDA transfer backends compile cuda/ with it")
    return Path(os.path.realpath(found))


def _key(source: Path, options: Sequence[str], arch: str, nvcc: Path) -> str:
    digest = hashlib.sha256(FORMAT)
    for part in (source.name, arch, *options, str(nvcc)):
        digest.update(b"\0" + part.encode())
    stat = nvcc.stat()
    digest.update(f"\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    for file in sorted(p for p in source.parent.iterdir() if p.is_file()):
        digest.update(b"\0" + file.name.encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


def _compile(nvcc: Path, source: Path, options: Sequence[str], arch: str) -> bytes:
    with tempfile.TemporaryDirectory(prefix="kvtool-nvcc-") as work:
        out = Path(work) / "kernel.cubin"
        done = subprocess.run([str(nvcc), "--cubin", f"-arch={arch}", *options, f"-I{source.parent}",
                               "-o", str(out), str(source)], capture_output=True, text=True, cwd=work)
        if done.returncode != 0 or not out.exists():
            message = (done.stderr or done.stdout).strip()[:2000]   # the first error explains the rest
            raise RuntimeError(f"nvcc could not compile {source.name} for {arch}: {message}")
        return out.read_bytes()


def _store(path: Path, binary: bytes) -> None:
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".partial-", suffix=".cubin")
        with os.fdopen(handle, "wb") as file:
            file.write(binary)
        os.replace(temporary, path)
    except OSError:
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
