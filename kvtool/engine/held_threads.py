"""Where a connector hands work to a thread: `ThreadPoolExecutor.submit` and `Thread.start`
intercepted, for the `HeldWork` installed last (one engine's at a time; none: the originals).

A held `submit` returns a `HeldFuture`; a held `start` returns with the thread not started, and
until it is released the thread says it is alive and `join` releases it first. A pool's own
worker threads are never held (their work is), and `shutdown` releases the pool's held work
before it waits for it, as a pool does.
"""

from __future__ import annotations

import concurrent.futures.thread as pool_threads
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import Any

from kvtool.engine.held_work import HeldFuture, HeldTask, HeldWork, Waitable
from kvtool.engine.hold_policy import HoldPoint

_ORIGINAL_SUBMIT = ThreadPoolExecutor.submit
_ORIGINAL_SHUTDOWN = ThreadPoolExecutor.shutdown
_ORIGINAL_START = threading.Thread.start
_ORIGINAL_JOIN = threading.Thread.join
_ORIGINAL_IS_ALIVE = threading.Thread.is_alive

_INSTALLED: list[HeldWork] = []
"""Installed `HeldWork`s, the last one active."""

_TASK = "_kvtool_held_task"
"""The attribute a held thread carries its task in."""
RELEASED = "_kvtool_released"
"""The attribute a released thread carries while a release waits for it (the gate lets it run)."""


def install(work: HeldWork) -> None:
    """From now on, `work` holds what connectors start (until `uninstall(work)`)."""
    if not _INSTALLED:
        ThreadPoolExecutor.submit = _submit                # type: ignore[method-assign,assignment]
        ThreadPoolExecutor.shutdown = _shutdown            # type: ignore[method-assign,assignment]
        threading.Thread.start = _start                    # type: ignore[method-assign,assignment]
        threading.Thread.join = _join                      # type: ignore[method-assign,assignment]
        threading.Thread.is_alive = _is_alive              # type: ignore[method-assign,assignment]
    _INSTALLED.append(work)


def uninstall(work: HeldWork) -> None:
    """`work` holds nothing more (its held work is its own to release first); the originals back
    once no `HeldWork` is installed."""
    if work in _INSTALLED:
        _INSTALLED.remove(work)
    if not _INSTALLED:
        ThreadPoolExecutor.submit = _ORIGINAL_SUBMIT       # type: ignore[method-assign]
        ThreadPoolExecutor.shutdown = _ORIGINAL_SHUTDOWN   # type: ignore[method-assign]
        threading.Thread.start = _ORIGINAL_START           # type: ignore[method-assign]
        threading.Thread.join = _ORIGINAL_JOIN             # type: ignore[method-assign]
        threading.Thread.is_alive = _ORIGINAL_IS_ALIVE     # type: ignore[method-assign]


def is_pool_worker(thread: threading.Thread) -> bool:
    """A `ThreadPoolExecutor`'s own thread (only while it has not started running its target)."""
    return getattr(thread, "_target", None) is pool_threads._worker


def _active() -> HeldWork | None:
    work = _INSTALLED[-1] if _INSTALLED else None
    return work if work is not None and work.intercepts() else None


def _submit(executor: ThreadPoolExecutor, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
    work = _active()
    if work is None or getattr(executor, "_shutdown", False):
        return _ORIGINAL_SUBMIT(executor, fn, *args, **kwargs)
    future = HeldFuture(work)

    def start() -> Waitable:
        return _start_pool_task(executor, fn, args, kwargs, future)

    future.task = work.hold(lambda hook, iteration, point: HeldTask(executor, start, hook, iteration, point,
                                                                    future=future))
    return future


def _start_pool_task(executor: ThreadPoolExecutor, fn: Callable[..., Any], args: tuple, kwargs: dict,
                     future: HeldFuture) -> Waitable:
    """Hand the task to the pool for real; its outcome becomes `future`'s before the wait ends."""
    if not future.set_running_or_notify_cancel():
        return Waitable(lambda timeout: True)
    try:
        real = _ORIGINAL_SUBMIT(executor, fn, *args, **kwargs)
    except RuntimeError as exc:      # the pool was shut down meanwhile: what submit would have raised
        future.set_exception(exc)
        return Waitable(lambda timeout: True)
    real.add_done_callback(lambda done: _copy_outcome(done, future))
    return Waitable(lambda timeout: _ended(future, timeout))


def _copy_outcome(real: Future, future: HeldFuture) -> None:
    error = real.exception()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(real.result())


def _ended(future: Future, timeout: float) -> bool:
    """Whether `future` ended within `timeout` (its base wait: nothing to release any more)."""
    try:
        Future.exception(future, timeout)
    except TimeoutError:
        return False
    except CancelledError:
        pass
    return True


def _shutdown(executor: ThreadPoolExecutor, wait: bool = True, *, cancel_futures: bool = False) -> None:
    for work in _INSTALLED:
        work.release_queue(executor)
    _ORIGINAL_SHUTDOWN(executor, wait, cancel_futures=cancel_futures)


def _start(thread: threading.Thread) -> None:
    work = _active()
    if work is None or is_pool_worker(thread) or getattr(thread, _TASK, None) is not None:
        _ORIGINAL_START(thread)
        return

    def start() -> Waitable:
        setattr(thread, RELEASED, True)
        _ORIGINAL_START(thread)
        return Waitable(lambda timeout: _thread_ended(thread, timeout))

    task = work.hold(lambda hook, iteration, point: HeldTask(thread, start, hook, iteration, point, thread=thread))
    setattr(thread, _TASK, task)


def _thread_ended(thread: threading.Thread, timeout: float) -> bool:
    _ORIGINAL_JOIN(thread, timeout)
    ended = not _ORIGINAL_IS_ALIVE(thread)
    setattr(thread, RELEASED, False)   # one still running is the gate's from now on
    return ended


def _held_task(thread: threading.Thread) -> HeldTask | None:
    task = getattr(thread, _TASK, None)
    return task if isinstance(task, HeldTask) and task.held else None


def _join(thread: threading.Thread, timeout: float | None = None) -> None:
    task = _held_task(thread)
    if task is not None:
        for work in _INSTALLED:
            work.waited(task)
    _ORIGINAL_JOIN(thread, timeout)


def _is_alive(thread: threading.Thread) -> bool:
    return _held_task(thread) is not None or _ORIGINAL_IS_ALIVE(thread)


__all__ = ["install", "uninstall", "is_pool_worker", "RELEASED", "HoldPoint"]
