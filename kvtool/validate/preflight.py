"""Importing and constructing the connector under test in a child process, before this process
touches it: a connector that ends its process (`os._exit`, `sys.exit`), hangs or raises while it
is imported or built is a usage error (InputError, exit 2) naming the stage, under the scenario
timeout, and cannot take `kvtool validate` down with it or make it exit 0 silently.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
from dataclasses import replace

import torch

from kvtool.connector.options import check_options, declared_options
from kvtool.connector.raised import describe_error, stops_kvtool, with_wrapped_location
from kvtool.connectors.registry import load_connector
from kvtool.errors import ConstructionError, InputError
from kvtool.validate.harness import Context, registration_error
from kvtool.validate.processes import scenario_processes
from kvtool.validate.user_store import engine_store_folders

IMPORTING, CHECKING, CONSTRUCTING = "importing it", "checking its options", "constructing its scheduler and worker"


def preflight(target: str, ctx: Context, compat: str | None, timeout: float, construct: bool = True) -> None:
    """Return once `target` imports, its declared options accept `ctx.options` and (`construct`)
    its classes construct for `ctx` (whose spec is ignored), in a fresh process within `timeout`
    seconds; InputError naming the stage otherwise."""
    mp = scenario_processes()
    receive, send = mp.Pipe(duplex=False)
    child = mp.Process(target=_child, args=(send, target, pickle.dumps(replace(ctx, spec=None)), compat, construct),
                       daemon=False)   # constructing with several ranks starts follower processes
    child.start()
    send.close()
    deadline = time.monotonic() + timeout
    stage, outcome = IMPORTING, None
    try:
        while outcome is None and receive.poll(max(0.0, deadline - time.monotonic())):
            kind, value = receive.recv()
            if kind == "stage":
                stage = value
            else:
                outcome = (kind, value)
    except EOFError:
        pass
    child.join(1.0 if outcome else 0.2)
    if child.is_alive():
        child.kill()
        child.join()
    if outcome is None:
        if child.exitcode in (None, -9):
            raise InputError(f"connector {target!r}: did not finish {stage} within {timeout:g} s (--timeout)")
        raise InputError(f"connector {target!r} ended its process (exit code {child.exitcode}) while {stage}: "
                         "a connector must raise, not exit")
    if outcome[0] == "error":
        raise InputError(outcome[1])


def _child(send, target: str, ctx_blob: bytes, compat: str | None, construct: bool) -> None:
    torch.set_num_threads(1)   # a forked child must not enter its parent's OpenMP pool (it would hang)
    stage = IMPORTING

    def enter(next_stage: str) -> None:
        nonlocal stage
        stage = next_stage
        send.send(("stage", stage))

    try:
        ctx: Context = pickle.loads(ctx_blob)
        enter(IMPORTING)
        spec = load_connector(target, compat)
        enter(CHECKING)
        declared = declared_options(spec.scheduler_class)
        if declared is not None:
            check_options(spec.name, declared, dict(ctx.options))
        if construct:
            enter(CONSTRUCTING)
            with tempfile.TemporaryDirectory(prefix="kvtool-validate-") as workdir:
                os.chdir(workdir)
                with engine_store_folders():
                    registration_error(replace(ctx, spec=spec))
        send.send(("ok", None))
    except SystemExit as exc:
        send.send(("error", f"connector {target!r} called sys.exit({exc.code!r}) while {stage}: "
                            "a connector must raise, not exit"))
    except BaseException as exc:  # noqa: BLE001 - whatever the target raises (a native panic too) is reported in one line
        if stops_kvtool(exc):
            raise
        send.send(("error", with_wrapped_location(exc) if isinstance(exc, ConstructionError) else
                   str(exc) if isinstance(exc, InputError) else
                   f"connector {target!r}: {describe_error(exc)} (while {stage})"))
    finally:
        send.close()
        os._exit(0)
