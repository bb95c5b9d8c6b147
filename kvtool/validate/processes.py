"""Where validate's child processes come from.

On a machine with CUDA they come from a fork server, not from forking this process: once a
process has initialised CUDA (a connector's pinned buffer does), a forked child cannot use CUDA at
all. The fork server is a clean process that preloads torch and kvtool once. Without CUDA, plain
fork is safe and starts a child faster. A child of the fork server has none of this process's
imports, so what it runs arrives pickled and is unpickled only after `--compat` modules exist.
"""

from __future__ import annotations

import functools
import multiprocessing

import torch


def scenario_processes(start_method: str | None = None):
    """The multiprocessing context: forkserver where CUDA exists, fork elsewhere."""
    return _context(start_method or ("forkserver" if torch.cuda.is_available() else "fork"))


@functools.lru_cache(maxsize=None)
def _context(start_method: str):
    mp = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        mp.set_forkserver_preload(["torch", "kvtool.validate.runner"])
    return mp
