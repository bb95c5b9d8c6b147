"""`--suite store` for any connector (a `MODULE:SCHED:WORKER` or `path/to/file.py:SCHED:WORKER`):
driven through the engine and the connector protocol only, never through its internals.

Per block size, one engine (bytes fidelity, pages poisoned when handed out, no local prefix reuse,
up to `Workload.per_pass` requests per pass: all of a round's by default) runs a cold round (N distinct
prompts of K full blocks plus half a block,
max_new_tokens 1: the connector saves the K blocks of each) then a warm round (the same prompts,
fresh request ids: the connector loads them), each to completion.

Timing: the wall clock inside the worker's hooks (`protocol_engine` says which). GB/s = blocks x
layout bytes per block / the union of those intervals; p50/p99 over requests. Save blocks: the full
prompt blocks the cold round computed; load blocks: the blocks the warm round delivered. Raw: one
contiguous copy of the same bytes, median of `repeats`: between two tensors in host memory for CPU
pools; for GPU pools the link itself, a pinned host buffer to or from the GPU in the row's
direction; ratio = GB/s / raw GB/s. Reference: kvtool's own `host` connector with the best transfer
backend for the device (`staged` on a GPU) driven through the same protocol in the same run;
vs_reference = GB/s / its GB/s in the same direction.

Verified: no integrity error in the fake engine (it checks every byte a pass reads) and each warm
request generated the cold request's tokens (the fake engine samples from a checksum of the KV).
"""

from __future__ import annotations

import gc
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from kvtool.bench.protocol_engine import (
    QUICK,
    Measured,
    Recorder,
    Workload,
    build_engine,
    check_bytes,
    four_digits,
    measure_round,
    one_line_errors,
    run_round,
)
from kvtool.bench.timing import time_repeats
from kvtool.connector.loader import ConnectorSpec
from kvtool.connector.store_namespace import store_namespace
from kvtool.engine.runtimes import DEFAULT_RUNTIME, RuntimeName

__all__ = ["QUICK", "Workload", "run_protocol_suite", "reference_connector", "reference_label", "connector_label"]

TOKENS_PER_BLOCK = (16, 32)
QUICK_TOKENS_PER_BLOCK = (16,)


@dataclass
class ProtocolRow:
    connector: str
    direction: str
    model: str
    tokens_per_block: int
    block_bytes: int
    blocks: int
    """Per round."""
    rounds: int
    gbps: float
    """The median of the rounds'."""
    spread: float | None
    """(max - min) / median of the rounds' GB/s; None for one round."""
    p50_us: float
    p99_us: float
    connector_ms: float
    """The round's time inside the connector (any hook, scheduler or worker), median of the rounds."""
    runtime_ms: float
    """The rest of the round's wall time: kvtool's scheduler, manager, fake forward and byte checks."""
    raw_gbps: float
    ratio: float
    vs_reference: float | None
    verified: bool

    def as_dict(self) -> dict:
        return asdict(self)


def run_protocol_suite(spec: ConnectorSpec, options: dict[str, str], model: str, tokens_per_block: list[int],
                       workload: Workload, repeats: int, device: str = "cpu",
                       reference: tuple[ConnectorSpec, dict[str, str]] | None = None, rounds: int = 1,
                       runtime: RuntimeName = DEFAULT_RUNTIME) -> tuple[list[ProtocolRow], list[str]]:
    """A save and a load row per block size (then the same for `reference`, the run's yardstick),
    each over `rounds` fresh engines, and one line per failed check (bytes not verified, nothing
    served in a warm round). `repeats`: of the raw copy. ConnectorError when a connector hook
    raised or the run stopped; InputError when the connector cannot be constructed or registered.
    Every engine plays `runtime`."""
    rows, problems = _connector_rows(spec, options, model, tokens_per_block, workload, repeats, device, rounds,
                                     runtime=runtime)
    if reference is None:
        return rows, problems
    ref_rows, ref_problems = _connector_rows(reference[0], reference[1], model, tokens_per_block, workload, repeats,
                                             device, rounds, reference_label(reference), runtime)
    yardstick = {(r.direction, r.tokens_per_block): r.gbps for r in ref_rows}
    for row in rows + ref_rows:
        base = yardstick.get((row.direction, row.tokens_per_block))
        row.vs_reference = four_digits(row.gbps / base) if base else None
    return rows + ref_rows, problems + ref_problems


def reference_connector(device: str) -> tuple[ConnectorSpec, dict[str, str]]:
    """kvtool's `host` connector with the fastest backend the device has (module docstring)."""
    from kvtool.connectors.registry import BUILTIN_CONNECTORS
    from kvtool.transfer.registry import best_backend
    return BUILTIN_CONNECTORS["host"], {"backend": best_backend(torch.device(device))}


REFERENCE_MARK = "(kvtool reference"
"""In a store run's `connector` column: the rows of kvtool's own connector, run as a yardstick."""


def reference_label(reference: tuple[ConnectorSpec, dict[str, str]]) -> str:
    """How the reference connector's rows are labelled."""
    return f"{reference[0].name} {REFERENCE_MARK}, backend {reference[1].get('backend', 'torch')})"


def _connector_rows(spec: ConnectorSpec, options: dict[str, str], model: str, tokens_per_block: list[int],
                    workload: Workload, repeats: int, device: str, rounds: int,
                    label: str | None = None, runtime: RuntimeName = DEFAULT_RUNTIME
                    ) -> tuple[list[ProtocolRow], list[str]]:
    rows, problems = [], []
    label = label or connector_label(spec.name)
    with store_namespace(label="bench"):      # a shared-server store starts cold and keeps to itself
        for tpb in tokens_per_block:
            results = []
            for _ in range(rounds):
                with one_line_errors(label):
                    results.append(_run_block_size(spec, options, label, model, tpb, workload, device, runtime))
                gc.collect()                  # the engine and the connector's store go before the next
            issue = next((r.issue for r in results if r.issue is not None), None)
            for direction in ("save", "load"):
                measured = [getattr(r, direction) for r in results]
                nbytes = max(measured[0].blocks, 1) * results[0].block_bytes
                rows.append(protocol_row(label, direction, model, tpb, results[0].block_bytes, measured,
                                         raw_gbps(nbytes, repeats, device, direction), issue is None))
            where = f"{label}, {tpb} tokens per block"
            if issue is not None:
                problems.append(f"{where}: not verified: {issue}")
            if any(r.load.blocks == 0 for r in results):
                problems.append(f"{where}: the connector served nothing in the warm round")
    return rows, problems


def connector_label(target: str) -> str:
    """`file.py:Sched:Worker` for a file target (its folder left out), the target otherwise."""
    where, sep, rest = target.partition(":")
    return f"{Path(where).name}{sep}{rest}" if where.endswith(".py") else target


@dataclass
class _BlockSize:
    block_bytes: int
    save: Measured
    load: Measured
    issue: str | None
    """Why the bytes are not verified; None when they are."""


def _run_block_size(spec: ConnectorSpec, options: dict[str, str], label: str, model: str, tpb: int,
                    workload: Workload, device: str, runtime: RuntimeName = DEFAULT_RUNTIME) -> _BlockSize:
    """The cold and the warm round on a fresh engine (closed before returning). Prompts are random
    per run, so a store that outlives the process (files, a server) starts cold too."""
    engine = build_engine(spec, options, model, tpb, workload, device, runtime)
    try:
        recorder = Recorder(engine)
        recorder.attach()
        prompts = workload.fresh_prompts(tpb)
        cold = run_round(engine, label, prompts, first_id=0, recorder=recorder)
        warm = run_round(engine, label, prompts, first_id=len(prompts), recorder=recorder)
        return _BlockSize(engine.manager.layout.bytes_per_block, measure_round(recorder, cold, "save", tpb),
                          measure_round(recorder, warm, "load", tpb), check_bytes(engine, cold, warm))
    finally:
        engine.close()


def raw_gbps(nbytes: int, repeats: int, device: str, direction: str = "save") -> float:
    """GB/s of one contiguous copy of `nbytes` (median of `repeats`): on a GPU over the link, from
    the GPU to pinned host memory for a save and back for a load; on a CPU between two host tensors,
    the better of torch's threads and one thread (waking the thread pool costs milliseconds on a
    busy machine, more than a small copy itself)."""
    source = torch.ones(nbytes, dtype=torch.uint8, device=device)
    if source.is_cuda:
        host = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
        source, target = (source, host) if direction == "save" else (host, source)
    else:
        target = torch.zeros_like(source)
    target.copy_(source)                       # warm-up: first touch of the target's pages
    cuda = source.is_cuda or target.is_cuda

    def median() -> float:
        return time_repeats(lambda: target.copy_(source, non_blocking=cuda), repeats, cuda=cuda).median
    seconds = median()
    if not cuda and torch.get_num_threads() > 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            seconds = min(seconds, median())
        finally:
            torch.set_num_threads(threads)
    return nbytes / seconds / 1e9


def protocol_row(label: str, direction: str, model: str, tpb: int, block_bytes: int, measured: list[Measured],
                 raw_gbps: float, verified: bool) -> ProtocolRow:
    """One direction over the rounds: the median GB/s and its spread, latencies over every request."""
    rates = [m.blocks * block_bytes / m.seconds / 1e9 if m.seconds > 0 else 0.0 for m in measured]
    gbps = float(np.median(rates))
    spread = four_digits((max(rates) - min(rates)) / gbps) if len(rates) > 1 and gbps > 0 else None
    latencies = np.array([s for m in measured for s in m.latencies]) * 1e6
    p50, p99 = (float(np.percentile(latencies, q)) if latencies.size else 0.0 for q in (50, 99))
    connector_ms = float(np.median([m.connector_seconds for m in measured])) * 1e3
    runtime_ms = float(np.median([m.round_seconds - m.connector_seconds for m in measured])) * 1e3
    return ProtocolRow(label, direction, model, tpb, block_bytes, measured[0].blocks, len(measured),
                       four_digits(gbps), spread, round(p50, 1), round(p99, 1), four_digits(connector_ms),
                       four_digits(runtime_ms), four_digits(raw_gbps),
                       four_digits(gbps / raw_gbps), None, verified)
