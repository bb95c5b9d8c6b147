"""A connector's background work, run when kvtool's schedule says: the runtime's side of every
race between a connector's threads and its own pages, decided in virtual time.

While installed (`held_threads` intercepts the calls), work a connector hands to a thread pool
(`ThreadPoolExecutor.submit`) or a thread (`Thread.start`) from one of its hooks, or from a thread
of its own, does not start: it is held, noted with the hook that started it and its iteration,
and released at a point of the iteration its `HoldPoint` names (`hold_policy`). Released work
runs for real, on the pool's thread or its own, while the releasing thread waits for it to end:
one task at a time, in the order the connector started them on each pool, so what lands before
what never depends on the operating system or a loaded machine, and no time passes waiting on the
clock. Work runs earlier than its point when something waits for it: the connector (a future's
`result`, `exception`, `concurrent.futures.wait`, a thread's `join`, a pool's `shutdown`), an
iteration in which nothing else can run (`release_all`), the end of the run.

What remains on the clock: a hook that waits for held work by other means (an event the work
sets, a queue) is seen only by the runtime's thread falling asleep inside it for HOOK_GRACE_S
(`HoldWarden`); released work that does not end within STALL_S (a thread that loops for the
connector's lifetime) is no longer waited for and runs on as the gate's (`async_gate`) to hold.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from kvtool.engine.hold_policy import HoldPoint, HoldPolicy, is_due

STALL_S = 2.0
"""How long a release waits for one task to end before it lets it run on unwatched."""


@dataclass(eq=False)
class HeldTask:
    """One piece of background work: `start` runs it for real and returns what to wait for."""

    queue: object
    """What orders it (the pool, or the thread itself): tasks of one queue run in start order."""
    start: Callable[[], Waitable]
    hook: str
    """The hook whose call started it (or "a connector thread")."""
    iteration: int
    point: HoldPoint
    held: bool = True
    future: HeldFuture | None = field(default=None, repr=False)
    thread: threading.Thread | None = field(default=None, repr=False)


class Waitable:
    """What a released task's end is: `wait(timeout) -> bool` (True once it ended)."""

    def __init__(self, wait: Callable[[float], bool]) -> None:
        self.wait = wait


@dataclass(frozen=True)
class Release:
    """A held task that ran: what started it, when, and what released it."""

    hook: str
    started_iteration: int
    iteration: int
    reason: str
    """"AFTER_HOOK", "GET_FINISHED", "GATE", "NEXT_GATE" (its point came), "waited" (the connector
    waited for it), "idle" (nothing else could run), "end" (the run ended)."""


class HeldWork:
    """The held tasks of one engine (rank 0 and the ranks in its process). `owner` is the runtime's
    thread: its calls are intercepted only inside a connector hook (`hook`)."""

    def __init__(self, policy: HoldPolicy, on_release: Callable[[Release], None] = lambda r: None,
                 iteration: Callable[[], int] = lambda: 0,
                 earliest: Callable[[], HoldPoint] = lambda: HoldPoint.AFTER_HOOK) -> None:
        """`iteration()`: the engine's iteration now; `earliest()`: the earliest point work started
        now may be drawn (the gate's, from a pass's first save hook on: see `connector_work`)."""
        self.policy = policy
        self._draws = policy.points()
        self._on_release = on_release
        self.owner = threading.get_ident()
        self._lock = threading.RLock()
        self._tasks: list[HeldTask] = []
        self._depth = 0
        self._label = ""
        self._iteration = iteration
        self._earliest = earliest
        self.releasing = threading.local()
        self.num_running = 0
        self.hook_seq = 0
        """Counts hook entries (the warden tells one long hook from several short ones)."""

    # ---- what is held -------------------------------------------------------------------------
    @property
    def num_held(self) -> int:
        return len(self._tasks)

    @property
    def in_hook(self) -> bool:
        return self._depth > 0

    def intercepts(self) -> bool:
        """Whether work started by the calling thread now is held: the runtime's thread inside a
        hook, any other thread but one running a release."""
        if getattr(self.releasing, "active", False):
            return False
        return self._depth > 0 if threading.get_ident() == self.owner else True

    def hold(self, task_of: Callable[[str, int, HoldPoint], HeldTask]) -> HeldTask:
        """Note a task (`task_of(hook, iteration, point)` builds it) as held."""
        with self._lock:
            hook = self._label if threading.get_ident() == self.owner else "a connector thread"
            task = task_of(hook, self._iteration(), max(self._draws.next(), self._earliest()))
            self._tasks.append(task)
            return task

    def is_held(self, task: HeldTask | None) -> bool:
        return task is not None and task.held

    # ---- the runtime's points -----------------------------------------------------------------
    @contextmanager
    def hook(self, label: str) -> Iterator[None]:
        """Around a connector hook: work it starts is held; once the outermost one returns, the
        tasks due after a hook run."""
        with self._lock:
            self._depth += 1
            self.hook_seq += 1
            outer, self._label = self._label, label
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                self._label = outer
            if self._depth == 0:
                self.at_point(HoldPoint.GET_FINISHED if label.startswith("get_finished") else HoldPoint.AFTER_HOOK)

    def at_point(self, at: HoldPoint) -> None:
        """Release the tasks due at `at` of the current iteration (GATE: the gate's turn)."""
        due = [t for t in self._tasks if is_due(t.point, t.iteration, self._iteration(), at)]
        if due:
            self._release(due, None)

    def release_all(self, reason: str) -> int:
        """Release every held task (`reason`: "idle", "end"); how many ran."""
        tasks = list(self._tasks)
        self._release(tasks, reason)
        return len(tasks)

    def waited(self, task: HeldTask | None) -> None:
        """Something waits for `task`: it runs now, after the tasks started before it on its queue."""
        if task is not None and task.held:
            self._release([task], "waited")

    def release_queue(self, queue: object) -> None:
        """Every held task of `queue` (a pool shut down with its work pending)."""
        self._release([t for t in self._tasks if t.queue is queue], "waited")

    # ---- running ------------------------------------------------------------------------------
    def _release(self, tasks: list[HeldTask], reason: str | None) -> None:
        """Run `tasks`, and the tasks started before each on its queue, one at a time in start
        order (`reason` None: each its own point's name)."""
        with self._lock:
            wanted = {id(t) for t in tasks if t.held}
            last = {id(t.queue): i for i, t in enumerate(self._tasks) if id(t) in wanted}
            chosen = [t for i, t in enumerate(self._tasks) if i <= last.get(id(t.queue), -1)]
            for t in chosen:
                t.held = False
            self._tasks = [t for t in self._tasks if t.held]
        for task in chosen:
            self._run(task, reason or task.point.name)

    def _run(self, task: HeldTask, reason: str) -> None:
        was, self.releasing.active = getattr(self.releasing, "active", False), True
        self.num_running += 1
        try:
            ended = task.start()
            ended.wait(STALL_S)
        finally:
            self.num_running -= 1
            self.releasing.active = was
        self._on_release(Release(task.hook, task.iteration, self._iteration(), reason))


class HeldFuture(Future):
    """The future a held pool task's `submit` returns: done once the task ran; waiting on it
    (`result`, `exception`, `concurrent.futures.wait`, `as_completed`) releases it."""

    def __init__(self, work: HeldWork) -> None:
        super().__init__()
        self._work = work
        self.task: HeldTask | None = None
        self._waiters: list = _ReleasingWaiters(self)

    def result(self, timeout: float | None = None) -> Any:
        self._work.waited(self.task)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._work.waited(self.task)
        return super().exception(timeout)


class _ReleasingWaiters(list):
    """A future's waiter list: a waiter installed (`concurrent.futures.wait`) releases the task,
    once it is in the list (so the task's end reaches it)."""

    def __init__(self, future: HeldFuture) -> None:
        super().__init__()
        self._future = future

    def append(self, waiter: Any) -> None:
        super().append(waiter)
        self._future._work.waited(self._future.task)
