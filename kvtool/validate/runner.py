"""Running scenarios: each in its own process (see `processes`), in a fresh working directory,
under a timeout, so a connector that hangs or crashes is reported instead of waited on."""

from __future__ import annotations

import gc
import os
import pickle
import tempfile
import time
from typing import Callable, Iterable

import torch

from kvtool.connector.store_namespace import store_namespace
from kvtool.connector.compat import install_compat
from kvtool.connector.raised import describe_error, format_error
from kvtool.validate.harness import Context, registration_error, take_tracebacks
from kvtool.validate.processes import scenario_processes
from kvtool.validate.results import CheckResult, Verdict
from kvtool.validate.scenarios import SCENARIOS

SETUP = "setup"


def run_scenario(name: str, ctx: Context) -> list[CheckResult]:
    """One scenario, here, in a fresh temporary working directory; errors become ERROR results."""
    started = time.perf_counter()
    here = os.getcwd()
    take_tracebacks()   # this scenario's only
    with tempfile.TemporaryDirectory(prefix="kvtool-validate-") as workdir, store_namespace(label="validate"):
        os.chdir(workdir)
        try:
            results = _setup(ctx) if name == SETUP else SCENARIOS[name].run(ctx)
        except Exception as exc:  # noqa: BLE001 - the scenario's failure is the finding
            error = describe_error(exc)
            results = [CheckResult(name, ctx.model, "scenario", Verdict.ERROR, 0.0, [error],
                                   [f"the scenario stopped: {error}\n{format_error(exc).rstrip()}"])]
        finally:
            os.chdir(here)
            # Engines hold reference cycles (callbacks into their owners), and the garbage collector
            # counts objects, not bytes: without this, in-process runs keep every scenario's pools
            # and connector stores alive (gigabytes after a dozen scenarios).
            gc.collect()
    seconds = round(time.perf_counter() - started, 3)
    for r in results:
        r.seconds = seconds
    _attach_tracebacks(results, take_tracebacks())
    return results


def _attach_tracebacks(results: list[CheckResult], tracebacks: list[str]) -> None:
    """The scenario's tracebacks go on its first result that did not pass, once; none are kept
    when every check passed (the failure hook-raises injects, say)."""
    first = next((r for r in results if r.verdict not in (Verdict.PASS, Verdict.SKIP)), None)
    if first is not None:
        first.tracebacks = [t for t in first.tracebacks if t not in tracebacks] + tracebacks


def _setup(ctx: Context) -> list[CheckResult]:
    error = registration_error(ctx)
    return [CheckResult(SETUP, ctx.model, "registration", Verdict.FAIL if error else Verdict.PASS, 0.0,
                        [error] if error else ["the layout was accepted"])]


def run_isolated(name: str, ctx: Context, timeout: float, start_method: str | None = None) -> list[CheckResult]:
    """`run_scenario` in a child process; a timeout or a dead child is an ERROR result.
    `start_method` defaults to forkserver where CUDA exists, fork elsewhere."""
    mp = scenario_processes(start_method)
    receive, send = mp.Pipe(duplex=False)
    # not a daemon: a scenario with several ranks starts its follower processes
    child = mp.Process(target=_child, args=(send, name, pickle.dumps(ctx), ctx.compat), daemon=False)
    started = time.perf_counter()
    child.start()
    send.close()
    results = None
    if receive.poll(timeout):
        try:
            results = receive.recv()
        except EOFError:
            results = None
    child.join(1.0)
    if child.is_alive():
        child.kill()
        child.join()
    if results is not None:
        return results
    seconds = round(time.perf_counter() - started, 3)
    why = (f"did not finish within {timeout:g} s (a connector hook hung?)" if child.exitcode in (None, -9)
           else f"the scenario's process died (exit code {child.exitcode})")
    return [CheckResult(name, ctx.model, "scenario", Verdict.ERROR, seconds, [why])]


def _child(send, name: str, ctx_blob: bytes, compat: str | None) -> None:
    # A forked child must not enter the OpenMP pool its parent may have started (it would hang);
    # with one thread torch runs everything inline. The scenarios are small.
    torch.set_num_threads(1)
    try:
        install_compat(compat)   # before the connector's classes are imported again by unpickling
        send.send(run_scenario(name, pickle.loads(ctx_blob)))
    finally:
        send.close()
        os._exit(0)


def run_all(contexts: Iterable[Context], names: list[str], timeout: float, isolated: bool = True,
            on_result: Callable[[list[CheckResult]], None] | None = None) -> list[CheckResult]:
    """Registration first for each model; a model whose layout the connector refuses runs nothing else."""
    everything: list[CheckResult] = []
    for ctx in contexts:
        for name in [SETUP] + names:
            results = run_isolated(name, ctx, timeout) if isolated else run_scenario(name, ctx)
            everything += results
            if on_result:
                on_result(results)
            if name == SETUP and any(r.failed for r in results):
                break
    return everything
