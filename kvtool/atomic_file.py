"""Files published whole: written beside their place under a temporary name, flushed to disk,
then renamed into place, so a reader (another process) sees the whole file or none."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

TEMPORARY_GLOB = ".*.tmp"
"""What `publish`'s temporary files match, whatever file they stand for (a folder's sweep)."""


def temporaries_of(path: Path) -> list[Path]:
    """The temporary files `publish` has left beside `path`: its writers' still running, or killed."""
    return list(path.parent.glob(f".{path.name}.*.tmp"))


def publish(path: Path, data: bytes, mode: int | None = None) -> None:
    """`data` at `path`, whole or not at all; its folder created. `mode`: the file's permissions
    where the file system allows them (else mkstemp's private 0600). The temporary file is
    `.NAME.XXXX.tmp` beside it (`temporaries_of`, `TEMPORARY_GLOB`); on any failure it is
    removed and the failure raised."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            if mode is not None:
                with contextlib.suppress(OSError):
                    os.fchmod(handle.fileno(), mode)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
