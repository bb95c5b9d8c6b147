"""`kvtool validate --compat vllm`: every vLLM scenario against one connector, each in a process of
its own (forked once vLLM is imported, so that an import costs once), in a fresh folder, under a
timeout; results in the shape of every other validate run (`CheckResult`, runtime `vllm`).

A model's first row is its registration: vLLM's scheduler built with the connector, and a worker
handed its KV caches (`register_kv_caches`); where that fails, the model's scenarios are skipped.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvtool.connector.raised import describe_error, format_error
from kvtool.engine.runtimes.names import VLLM_RUNTIME
from kvtool.validate.results import CheckResult, Verdict
from kvtool.vllm_compat.driver import VllmRun
from kvtool.vllm_compat.hook_log import HookFailed
from kvtool.vllm_compat.install import require_vllm
from kvtool.vllm_compat.scenarios import SCENARIOS, VllmContext, engine
from kvtool.vllm_compat.target import ConnectorTarget

DEFAULT_MODELS = ["tiny", "tiny-vswa"]
SETUP = "setup"


def validate_vllm(target: ConnectorTarget, models: list[str], block_size: int, seed: int, names: list[str],
                  timeout: float, on_result: Callable[[list[CheckResult]], None] = lambda rs: None
                  ) -> list[CheckResult]:
    """Every scenario of `names` for every model, in order; `on_result` is told each scenario's results."""
    require_vllm()
    results: list[CheckResult] = []
    for model in models:
        ctx = VllmContext(target, model, block_size, seed)
        setup = run_in_child(SETUP, ctx, timeout)
        on_result(setup)
        results += setup
        registered = not any(r.failed for r in setup)
        for name in names:
            rows = run_in_child(name, ctx, timeout) if registered else \
                [_stamp(CheckResult(name, model, "scenario", Verdict.SKIP, evidence=["the registration failed"]))]
            on_result(rows)
            results += rows
    return results


def run_in_child(name: str, ctx: VllmContext, timeout: float) -> list[CheckResult]:
    """One scenario in a forked child; a child that hangs past `timeout` or dies is an ERROR row."""
    started = time.perf_counter()
    mp = multiprocessing.get_context("fork")
    receiver, sender = mp.Pipe(duplex=False)
    child = mp.Process(target=_child, args=(name, ctx, sender), daemon=True)
    child.start()
    sender.close()
    rows = _receive(receiver, child, timeout, name, ctx.model)
    seconds = round(time.perf_counter() - started, 3)
    for row in rows:
        row.seconds = seconds
    return rows


def _receive(receiver: Any, child: Any, timeout: float, name: str, model: str) -> list[CheckResult]:
    if receiver.poll(timeout):
        try:
            rows: list[CheckResult] = receiver.recv()
        except EOFError:
            rows = []
        child.join(5)
        if rows:
            return rows
        why = f"the scenario's process ended with exit code {child.exitcode} before it reported"
    else:
        child.kill()
        child.join()
        why = f"the scenario did not end within {timeout:g} s (stopped)"
    return [_stamp(CheckResult(name, model, "scenario", Verdict.ERROR, evidence=[why]))]


def _child(name: str, ctx: VllmContext, sender: Any) -> None:
    with tempfile.TemporaryDirectory(prefix="kvtool-vllm-") as folder:
        os.chdir(folder)
        sender.send(run_here(name, replace(ctx, folder=Path(folder))))
    sender.close()


def run_here(name: str, ctx: VllmContext) -> list[CheckResult]:
    """One scenario in this process; a connector's exception (or vLLM's on its account) is the
    scenario's ERROR row with where it was raised."""
    check = "registration" if name == SETUP else "scenario"
    try:
        rows = _setup(ctx) if name == SETUP else SCENARIOS[name].run(ctx)
    except HookFailed as exc:
        rows = [CheckResult(name, ctx.model, check, Verdict.FAIL, evidence=[str(exc)], tracebacks=[exc.traceback])]
    except Exception as exc:  # noqa: BLE001 - the connector's (or its setup's) failure is the finding
        rows = [CheckResult(name, ctx.model, check, Verdict.FAIL if name == SETUP else Verdict.ERROR,
                            evidence=[f"the run stopped: {describe_error(exc)}"], tracebacks=[format_error(exc)])]
    return [_stamp(row) for row in rows]


def _setup(ctx: VllmContext) -> list[CheckResult]:
    run: VllmRun = engine(ctx)
    groups = len(run.scheduler.kv_cache_config.kv_cache_groups)
    layout = run.built.vllm_config.cache_config.kv_cache_layout
    return [CheckResult(SETUP, ctx.model, "registration", Verdict.PASS,
                        evidence=[f"vLLM's scheduler built with {type(run.connector).__name__}; the worker took "
                                  f"{len(run.workers[0].tensors)} layer tensors ({layout}, {groups} KV cache "
                                  f"group{'s' * (groups != 1)})"])]


def _stamp(row: CheckResult) -> CheckResult:
    row.runtime = VLLM_RUNTIME
    return row
