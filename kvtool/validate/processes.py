"""Where validate's child processes come from.

On a machine with CUDA they come from a fork server, not from forking this process: once a
process has initialised CUDA (a connector's pinned buffer does), a forked child cannot use CUDA at
all. The fork server is a clean process that preloads torch and kvtool once. Without CUDA, plain
fork is safe and starts a child faster. A child of the fork server has none of this process's
imports, so what it runs arrives pickled and is unpickled only after `--compat` modules exist.
"""

from __future__ import annotations

import ctypes
import functools
import multiprocessing

import torch

CU_CTX_SCHED_BLOCKING_SYNC = 0x04


def scenario_processes(start_method: str | None = None):
    """The multiprocessing context: forkserver where CUDA exists, fork elsewhere."""
    return _context(start_method or ("forkserver" if torch.cuda.is_available() else "fork"))


@functools.cache
def _context(start_method: str):
    mp = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        mp.set_forkserver_preload(["torch", "kvtool.validate.runner"])
    return mp


def sleep_while_waiting_for_the_gpu() -> bool:
    """Set every GPU's primary context to block (sleep) rather than spin while a thread of this
    process waits for the GPU: a synchronising copy, a stream or event wait. Call it before the
    process first uses CUDA. Returns whether it was set (False without a CUDA driver, or with one
    too old to have these entry points: the process then waits as CUDA's default has it).

    Why: with one context in a process, CUDA spins a CPU core for every wait by default. validate
    runs up to a core's worth of scenario processes on one GPU, whose small synchronising copies
    each wait for the GPU's time slice; spinning, they took the CPU the other processes needed
    (`results/h100-gpu-kit-study/`). A connector sees no difference but a wake-up's latency."""
    if not torch.cuda.is_available():
        return False
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        set_flags = getattr(driver, "cuDevicePrimaryCtxSetFlags_v2", None) or driver.cuDevicePrimaryCtxSetFlags
    except (OSError, AttributeError):
        return False
    count = ctypes.c_int()
    if driver.cuInit(0) or driver.cuDeviceGetCount(ctypes.byref(count)):
        return False
    for ordinal in range(count.value):
        device = ctypes.c_int()
        if driver.cuDeviceGet(ctypes.byref(device), ordinal) or set_flags(device, CU_CTX_SCHED_BLOCKING_SYNC):
            return False
    return True
