"""When a connector's own threads may run: the runtime's side of a race, made deterministic.

A connector that copies in the background races the runtime. Between the end of a pass's
`wait_for_save` and the moment the pages of the saves `get_finished` reported are released (and
poisoned), the gate is closed: every Python thread started while it is installed (a connector's
copy thread) stops at its next function call until the gate opens again. Inside a connector hook
it stays shut unless the hook runs longer than HOOK_GRACE_S (it may be waiting for its own
threads: they are let through, so it never deadlocks). A save reported finished
is therefore judged on what the store held at the moment of the report, whoever would have won
the race: a copy still queued then reads poison.

Threads are stopped only at Python function calls: work already inside one C call (one torch
copy, a CUDA stream's queue) runs on; threads started before `install` are not gated.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator


HOOK_GRACE_S = 0.02
"""How long the runtime's thread must be seen asleep without a break, inside a connector hook run
while the gate is closed, before the connector's threads are let through (Linux: its state in
/proc, sampled five times a grace; elsewhere the time alone decides). A hook that waits for its
own threads (a get_finished that blocks until its copies landed) would otherwise wait forever;
one that is only slow (preempted on a loaded machine: runnable, not asleep; or a moment's wait
for the GIL) keeps the gate shut."""


class AsyncGate:
    """Closed (`close`) from the end of a pass's saves until `open`; a hook that runs longer than
    HOOK_GRACE_S meanwhile opens it for the rest of its run."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()
        self._closed_by_runtime = False
        self._hook_since: float | None = None
        self._owner = threading.get_ident()
        self._owner_native = threading.get_native_id()
        self._installed = False

    def install(self) -> None:
        """Gate every thread started from now on (`threading.settrace`: a check at each call)."""
        threading.settrace(self._trace)
        self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            threading.settrace(None)   # type: ignore[arg-type]
            self._installed = False
        self.open()

    def close(self) -> None:
        self._closed_by_runtime = True
        self._open.clear()

    def open(self) -> None:
        self._closed_by_runtime = False
        self._open.set()

    @contextmanager
    def hook(self) -> Iterator[None]:
        """Around a connector hook: the time it started, for HOOK_GRACE_S."""
        outer, self._hook_since = self._hook_since, time.monotonic()
        try:
            yield
        finally:
            self._hook_since = outer

    def _trace(self, frame, event: str, arg):
        if event == "call" and threading.get_ident() != self._owner:
            asleep_since = None
            while not self._open.wait(HOOK_GRACE_S / 5):
                now = time.monotonic()
                in_hook = self._hook_since is not None
                asleep_since = (asleep_since or now) if in_hook and self._owner_asleep() else None
                if asleep_since is not None and now - asleep_since > HOOK_GRACE_S:
                    break
        return None

    def _owner_asleep(self) -> bool:
        """Whether the runtime's thread sleeps (waits for a lock, a future, I/O): True where the
        kernel does not say (no /proc)."""
        try:
            with open(f"/proc/self/task/{self._owner_native}/stat", "rb") as stat:
                return stat.read().rsplit(b")", 1)[1].split()[0] in (b"S", b"D")
        except (OSError, IndexError):
            return True
