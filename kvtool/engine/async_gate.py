"""When a connector's own threads may run: the runtime's side of a race, made deterministic.

A connector that copies in the background races the runtime. Between a pass's first save hook
(`save_kv_layer`, else `wait_for_save`: where saves are submitted) and the moment the pages of the saves
`get_finished` reported are released (and poisoned), the gate is closed: every Python thread started while
it is installed (a connector's copy thread) stops at its next function call until the gate opens again.
Inside a connector hook it stays shut unless the hook runs longer than HOOK_GRACE_S (it may be waiting for its own
threads: they are let through, so it never deadlocks). A save reported finished
is therefore judged on what the store held at the moment of the report, whoever would have won
the race: a copy still queued then reads poison. When the gate opens, the runtime waits until the
work it held has run (`drain`: no gated thread held, calling for QUIET_S, or runnable), so that
what lands before the next pass's saves depends neither on the GIL nor on a loaded machine making a
copy thread wait for a core. (A thread in uninterruptible I/O, or waiting on a socket or a lock,
counts as idle; one that never goes quiet costs DRAIN_LIMIT_S an iteration.)

Threads are stopped only at Python function calls: work already inside one C call (one torch
copy, a CUDA stream's queue) runs on; threads started before `install` are not gated, nor are
those `exempt` names (a thread pool's workers, whose work `held_work` holds task by task, and a
thread a release waits for): "held" means held at the next Python call, never inside native code.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

HOOK_GRACE_S = 0.02
"""How long the runtime's thread must be seen asleep without a break, inside a connector hook run
while the gate is closed, before the connector's threads are let through (Linux: its state in
/proc, sampled five times a grace; elsewhere the time alone decides). A hook that waits for its
own threads (a get_finished that blocks until its copies landed) would otherwise wait forever;
one that is only slow (preempted on a loaded machine: runnable, not asleep; or a moment's wait
for the GIL) keeps the gate shut."""


QUIET_S = 0.002
"""How long no gated thread may have made a call, none being held and none runnable, before the
work let through at `open` counts as done (a thread waiting on its queue makes no calls and sleeps).
Runnable counts because on a loaded machine a copy thread can wait for a core longer than QUIET_S."""
DRAIN_LIMIT_S = 0.2
"""The longest `open` waits for the gated threads to go quiet (a connector that polls in a loop never does)."""

SAVE_HOOKS = frozenset({"save_kv_layer", "wait_for_save"})
"""The hooks that submit a pass's saves: the gate closes before the first of them runs, so that a
copy submitted there cannot land before the report (or not) depending on the GIL's whim."""


class AsyncGate:
    """Closed (`close`, or a save hook: `before_hook`) until `open`; a hook that runs longer than
    HOOK_GRACE_S meanwhile opens it for the rest of its run."""

    def __init__(self, exempt: Callable[[threading.Thread], bool] = lambda thread: False,
                 untraced: Callable[[threading.Thread], bool] = lambda thread: False) -> None:
        """`exempt(thread)`: let it through now (asked at each call); `untraced(thread)`: never
        gate it (asked at its first call, its tracing then switched off)."""
        self._exempt = exempt
        self._untraced = untraced
        self._seen: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
        self._open = threading.Event()
        self._open.set()
        self._closed_by_runtime = False
        self._hook_since: float | None = None
        self._owner = threading.get_ident()
        self._owner_native = threading.get_native_id()
        self._installed = False
        self._num_held = 0
        self._count_lock = threading.Lock()
        self._last_call = 0.0
        """When a gated thread last made a call (monotonic seconds)."""
        self._gated_native_ids: set[int] = set()
        """The kernel's ids of the gated threads seen so far (to ask /proc whether they still run)."""

    def install(self) -> None:
        """Gate every thread started from now on (`threading.settrace`: a check at each call)."""
        threading.settrace(self._trace)
        self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            threading.settrace(None)   # type: ignore[arg-type]
            self._installed = False
        self.open(drain=False)

    def close(self) -> None:
        self._closed_by_runtime = True
        self._open.clear()

    @property
    def is_closed(self) -> bool:
        return not self._open.is_set()

    def before_hook(self, hook: str) -> None:
        """Told the worker hook about to run: a save hook closes the gate."""
        if hook in SAVE_HOOKS:
            self.close()

    def open(self, drain: bool = True) -> None:
        """Let the gated threads run; `drain`: and wait until they went quiet (at most DRAIN_LIMIT_S)."""
        self._closed_by_runtime = False
        self._open.set()
        if drain:
            self._drain()

    def _drain(self) -> None:
        deadline = time.monotonic() + DRAIN_LIMIT_S
        while (now := time.monotonic()) < deadline:
            if not self._num_held and now - self._last_call > QUIET_S and not self._any_gated_runnable():
                return
            time.sleep(QUIET_S / 4)

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
            if self._skips(threading.current_thread()):
                return None
            self._last_call = time.monotonic()
            self._gated_native_ids.add(threading.get_native_id())
            if not self._open.is_set():
                with self._count_lock:
                    self._num_held += 1
                try:
                    self._hold()
                finally:
                    with self._count_lock:
                        self._num_held -= 1
                    self._last_call = time.monotonic()
        return None

    def _skips(self, thread: threading.Thread) -> bool:
        """Whether `thread` goes ungated (an untraced one is no longer traced at all)."""
        if thread not in self._seen:
            self._seen.add(thread)
            if self._untraced(thread):
                sys.settrace(None)
                return True
        return self._exempt(thread)

    def _hold(self) -> None:
        """Wait until the gate opens, or the runtime's thread sleeps in a hook for HOOK_GRACE_S."""
        asleep_since = None
        while not self._open.wait(HOOK_GRACE_S / 5):
            now = time.monotonic()
            in_hook = self._hook_since is not None
            asleep_since = (asleep_since or now) if in_hook and self._owner_asleep() else None
            if asleep_since is not None and now - asleep_since > HOOK_GRACE_S:
                return

    def _owner_asleep(self) -> bool:
        """Whether the runtime's thread sleeps (waits for a lock, a future, I/O): True where the
        kernel does not say (no /proc)."""
        return thread_state(self._owner_native) in (b"S", b"D", None)

    def _any_gated_runnable(self) -> bool:
        """Whether a gated thread is running or waiting for a core (a thread that ended, or where
        the kernel does not say, is not; an ended one is forgotten, so a connector that starts a
        thread per copy does not make every later check read more files)."""
        states = {tid: thread_state(tid) for tid in list(self._gated_native_ids)}
        self._gated_native_ids.difference_update(tid for tid, state in states.items() if state is None)
        return b"R" in states.values()


    def has_live_threads(self) -> bool:
        """Whether a gated thread (one of the connector's own, seen making calls) is still alive."""
        states = {tid: thread_state(tid) for tid in list(self._gated_native_ids)}
        self._gated_native_ids.difference_update(tid for tid, state in states.items() if state is None)
        return bool(self._gated_native_ids)


def thread_state(native_id: int) -> bytes | None:
    """This process's thread's one-letter state from /proc (R running or runnable, S/D asleep);
    None where it ended or the kernel does not say."""
    try:
        with open(f"/proc/self/task/{native_id}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
