"""`--suite store` for any connector (a `MODULE:SCHED:WORKER` or `path/to/file.py:SCHED:WORKER`):
driven through the engine and the connector protocol only, never through its internals.

Per block size, one engine (bytes fidelity, pages poisoned when handed out, no local prefix reuse,
one request per pass) runs a cold round (N distinct prompts of K full blocks plus half a block,
max_new_tokens 1: the connector saves the K blocks of each) then a warm round (the same prompts,
fresh request ids: the connector loads them), each to completion.

Timing: the wall clock inside the worker's hooks, on the engine's iteration. A request's load is
the time inside `start_load_kv` and `wait_for_layer_load` in the pass that delivered it (an
asynchronous load: from its `LoadStarted` event to its `LoadFinished`); its save is the time inside
`save_kv_layer` and `wait_for_save` in the pass that computed it (plus, for an asynchronous save,
`SaveStarted` to `SaveFinished`). GB/s = blocks x layout bytes per block / the union of those
intervals; p50/p99 over requests. Save blocks: the full prompt blocks the cold round computed; load
blocks: the blocks the warm round delivered. Raw: one contiguous copy of the same bytes, median of
`repeats`: between two tensors in host memory for CPU pools; for GPU pools the link itself, a pinned
host buffer to or from the GPU in the row's direction; ratio = GB/s / raw GB/s. Reference: kvtool's
own `host` connector with the best transfer backend for the device (`staged` on a GPU) driven
through the same protocol in the same run; vs_reference = GB/s / its GB/s in the same direction.

Verified: no integrity error in the fake engine (it checks every byte a pass reads) and each warm
request generated the cold request's tokens (the fake engine samples from a checksum of the KV).
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import ClassVar, Iterator
from pathlib import Path

import numpy as np
import torch

from kvtool.bench.timing import time_repeats
from kvtool.connector.loader import ConnectorSpec
from kvtool.connector.request import Request
from kvtool.connector.store_namespace import store_namespace
from kvtool.engine.engine import Engine, EngineConfig
from kvtool.engine.events import Deliver, Finished, LoadFinished, LoadStarted, PassDone, SaveFinished, SaveStarted
from kvtool.engine.fake_engine import VOCAB_SIZE
from kvtool.engine.scheduler import SchedulerConfig
from kvtool.errors import ConnectorError, KvToolError
from kvtool.manager import KvCacheManagerConfig
from kvtool.models import load_model

TOKENS_PER_BLOCK = (16, 32)
QUICK_TOKENS_PER_BLOCK = (16,)
LOAD_HOOKS = ("start_load_kv", "wait_for_layer_load")
SAVE_HOOKS = ("save_kv_layer", "wait_for_save")


@dataclass(frozen=True)
class Workload:
    """N prompts of K full blocks each (plus half a block the connector never sees whole)."""

    prompts: int = 8
    blocks: int = 4

    def token_lists(self, tokens_per_block: int, rng: np.random.Generator) -> list[list[int]]:
        length = self.blocks * tokens_per_block + max(1, tokens_per_block // 2)
        return [rng.integers(0, VOCAB_SIZE, length).tolist() for _ in range(self.prompts)]


QUICK = Workload(prompts=4, blocks=4)


@dataclass
class ProtocolRow:
    connector: str
    direction: str
    model: str
    tokens_per_block: int
    block_bytes: int
    blocks: int
    gbps: float
    p50_us: float
    p99_us: float
    raw_gbps: float
    ratio: float
    vs_reference: float | None
    verified: bool

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Recorder:
    """What one engine's run shows of its requests' loads and saves: worker hook intervals
    `(kind, iteration, start, end)` and the events, wall-clocked (request ids and iterations never
    repeat, so one recorder serves both rounds)."""

    event_kinds: ClassVar[frozenset] = frozenset({PassDone, LoadStarted, LoadFinished, SaveStarted, SaveFinished,
                                                  Deliver, Finished})
    engine: Engine
    hooks: list[tuple[str, int, float, float]] = field(default_factory=list)
    computed_in: dict[int, int] = field(default_factory=dict)
    load_start: dict[int, tuple[int, float, bool]] = field(default_factory=dict)
    async_end: dict[tuple[str, int], float] = field(default_factory=dict)
    save_start: dict[int, float] = field(default_factory=dict)
    finished: dict[int, Finished] = field(default_factory=dict)
    delivered: dict[int, int] = field(default_factory=dict)

    def attach(self) -> None:
        """Subscribe to the engine's events and wrap every worker's load and save hooks."""
        self.engine.events.subscribe(self)
        for worker in self.engine.connector.workers:
            for hook in LOAD_HOOKS + SAVE_HOOKS:
                self._wrap(worker, hook, "load" if hook in LOAD_HOOKS else "save")

    def _wrap(self, worker, hook: str, kind: str) -> None:
        inner = getattr(worker, hook)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.hooks.append((kind, self.engine.iteration, start, time.perf_counter()))
        setattr(worker, hook, timed)

    def __call__(self, event) -> None:
        now = time.perf_counter()
        if isinstance(event, PassDone):
            for request_id, _, _ in event.items:
                self.computed_in.setdefault(request_id, event.iteration)
        elif isinstance(event, LoadStarted):
            self.load_start[event.request_id] = (event.iteration, now, event.is_async)
        elif isinstance(event, (LoadFinished, SaveFinished)):
            self.async_end[("load" if isinstance(event, LoadFinished) else "save", event.request_id)] = now
        elif isinstance(event, SaveStarted):
            self.save_start[event.request_id] = now
        elif isinstance(event, Deliver):
            self.delivered[event.request_id] = event.num_external
        elif isinstance(event, Finished):
            self.finished[event.request_id] = event

    def intervals(self, kind: str, request_id: int) -> list[tuple[float, float]]:
        """The wall-clock intervals of `request_id`'s load or save (module docstring)."""
        if kind == "load":
            iteration, started, is_async = self.load_start[request_id]
            if is_async:
                return [(started, self.async_end.get(("load", request_id), started))]
        else:
            iteration = self.computed_in.get(request_id, -1)
        spans = [(s, e) for k, i, s, e in self.hooks if k == kind and i == iteration]
        if kind == "save" and request_id in self.save_start:
            spans.append((self.save_start[request_id], self.async_end.get(("save", request_id),
                                                                          self.save_start[request_id])))
        return spans


@dataclass
class Measured:
    """One direction of one block size: blocks moved, seconds (union of intervals), per-request seconds."""

    blocks: int
    seconds: float
    latencies: list[float]


def run_protocol_suite(spec: ConnectorSpec, options: dict[str, str], model: str, tokens_per_block: list[int],
                       workload: Workload, repeats: int, device: str = "cpu",
                       reference: tuple[ConnectorSpec, dict[str, str]] | None = None
                       ) -> tuple[list[ProtocolRow], list[str]]:
    """A save and a load row per block size (then the same for `reference`, the run's yardstick),
    and one line per failed check (bytes not verified, nothing served in the warm round).
    ConnectorError when a connector hook raised or the run stopped; InputError when the connector
    cannot be constructed or registered."""
    rows, problems = _connector_rows(spec, options, model, tokens_per_block, workload, repeats, device)
    if reference is None:
        return rows, problems
    label = f"{reference[0].name} (kvtool reference, backend {reference[1].get('backend', 'torch')})"
    ref_rows, ref_problems = _connector_rows(reference[0], reference[1], model, tokens_per_block, workload, repeats,
                                             device, label)
    yardstick = {(r.direction, r.tokens_per_block): r.gbps for r in ref_rows}
    for row in rows + ref_rows:
        base = yardstick.get((row.direction, row.tokens_per_block))
        row.vs_reference = _digits(row.gbps / base) if base else None
    return rows + ref_rows, problems + ref_problems


def reference_connector(device: str) -> tuple[ConnectorSpec, dict[str, str]]:
    """kvtool's `host` connector with the fastest backend the device has (module docstring)."""
    from kvtool.connectors.registry import BUILTIN_CONNECTORS
    from kvtool.transfer.registry import best_backend
    return BUILTIN_CONNECTORS["host"], {"backend": best_backend(torch.device(device))}


def _connector_rows(spec: ConnectorSpec, options: dict[str, str], model: str, tokens_per_block: list[int],
                    workload: Workload, repeats: int, device: str,
                    label: str | None = None) -> tuple[list[ProtocolRow], list[str]]:
    rows, problems = [], []
    label = label or connector_label(spec.name)
    with store_namespace(label="bench"):      # a shared-server store starts cold and keeps to itself
        for tpb in tokens_per_block:
            with _one_line_errors(label):
                result = _run_block_size(spec, options, label, model, tpb, workload, device)
            gc.collect()                      # the engine and the connector's store go before the raw copy
            raw: dict[tuple[str, int], float] = {}
            for direction, measured in (("save", result.save), ("load", result.load)):
                nbytes = max(measured.blocks, 1) * result.block_bytes
                raw.setdefault((direction, nbytes), _raw_gbps(nbytes, repeats, device, direction))
                rows.append(_row(label, direction, model, tpb, result.block_bytes, measured,
                                 raw[(direction, nbytes)], result.issue is None))
            where = f"{label}, {tpb} tokens per block"
            if result.issue is not None:
                problems.append(f"{where}: not verified: {result.issue}")
            if result.load.blocks == 0:
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
                    workload: Workload, device: str) -> _BlockSize:
    """The cold and the warm round on a fresh engine (closed before returning). Prompts are random
    per run, so a store that outlives the process (files, a server) starts cold too."""
    engine = _engine(spec, options, model, tpb, workload, device)
    try:
        recorder = Recorder(engine)
        recorder.attach()
        prompts = workload.token_lists(tpb, np.random.default_rng(int.from_bytes(os.urandom(8), "little")))
        cold = _round(engine, label, prompts, first_id=0)
        warm = _round(engine, label, prompts, first_id=len(prompts))
        return _BlockSize(engine.manager.layout.bytes_per_block, _measure(recorder, cold, "save", tpb),
                          _measure(recorder, warm, "load", tpb), _check(engine, cold, warm))
    finally:
        engine.close()


def _engine(spec: ConnectorSpec, options: dict[str, str], model: str, tpb: int, workload: Workload,
            device: str) -> Engine:
    """One request per pass, no local prefix reuse (the warm round must ask the connector), pages
    poisoned when handed out (a load that writes nothing reads as wrong bytes), and room for every
    prompt at once (asynchronous loads and saves hold pages outside the batch) plus a spare page."""
    slots = workload.prompts * (workload.blocks + 1) + 1
    manager = KvCacheManagerConfig(load_model(model), tpb, num_slots=slots, device=device, poison_new_pages=True)
    config = EngineConfig(manager, SchedulerConfig(max_batch_size=1, local_reuse=False),
                          max_transmission_seconds=60.0)
    return Engine(config, spec, options)


@dataclass
class _Round:
    ids: list[int]
    tokens: list[list[int]]
    """Generated tokens per request, in prompt order."""


def _round(engine: Engine, label: str, prompts: list[list[int]], first_id: int) -> _Round:
    """Run `prompts` as new requests (ids from `first_id`) to completion; ConnectorError, in one
    line, when a hook raised or a request failed."""
    ids = list(range(first_id, first_id + len(prompts)))
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(Request(request_id, prompt, max_new_tokens=1))
    engine.run()
    if engine.connector.failures:
        raise ConnectorError(_one_line(f"connector {label}: {engine.connector.failures[0].describe()}"))
    if engine.stats.failures:                   # e.g. an asynchronous load never reported
        raise ConnectorError(_one_line(f"connector {label}: {engine.stats.failures[0]}"))
    return _Round(ids, [engine.states[i].request.generated_token_ids for i in ids])


def _one_line(text: str) -> str:
    return " ".join(text.split())


@contextlib.contextmanager
def _one_line_errors(label: str) -> Iterator[None]:
    """A kvtool error keeps its kind (so its exit code) in one line; anything else raised on the
    way (from the connector's code) becomes a ConnectorError naming the connector."""
    try:
        yield
    except KvToolError as exc:
        raise type(exc)(_one_line(str(exc))) from None
    except Exception as exc:  # noqa: BLE001 - the connector's failure, said in one line
        raise ConnectorError(_one_line(f"connector {label}: the run stopped: {type(exc).__name__}: {exc}")) from None


def _measure(recorder: Recorder, round_: _Round, kind: str, tpb: int) -> Measured:
    """Blocks, seconds and per-request seconds of the round's loads or saves (module docstring)."""
    if kind == "load":
        ids = [i for i in round_.ids if recorder.delivered.get(i, 0) > 0 and i in recorder.load_start]
        blocks = sum(math.ceil(recorder.delivered[i] / tpb) for i in ids)
    else:
        ids = round_.ids
        blocks = sum(_computed_blocks(recorder.finished[i], tpb) for i in ids if i in recorder.finished)
    spans = {i: recorder.intervals(kind, i) for i in ids}
    latencies = [sum(e - s for s, e in _union(spans[i])) for i in ids]
    total = sum(e - s for s, e in _union([s for i in ids for s in spans[i]]))
    return Measured(blocks, total, latencies)


def _computed_blocks(event: Finished, tpb: int) -> int:
    """Full prompt blocks the engine computed (not served from a cache): what a connector saves."""
    return event.prompt_len // tpb - (event.num_local_hit + event.num_external) // tpb


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def _check(engine: Engine, cold: _Round, warm: _Round) -> str | None:
    """None when every byte read was right and every warm request generated the cold one's tokens."""
    if engine.integrity_errors:
        first = engine.fake.issues[0].describe() if engine.fake.issues else ""
        return f"{engine.integrity_errors} integrity error(s) in the KV bytes ({first})"
    differ = [i for i, (a, b) in enumerate(zip(cold.tokens, warm.tokens)) if a != b]
    if differ:
        return f"{len(differ)} of {len(cold.tokens)} warm prompts generated other tokens than cold"
    return None


def _raw_gbps(nbytes: int, repeats: int, device: str, direction: str = "save") -> float:
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


def _row(label: str, direction: str, model: str, tpb: int, block_bytes: int, measured: Measured, raw_gbps: float,
         verified: bool) -> ProtocolRow:
    gbps = measured.blocks * block_bytes / measured.seconds / 1e9 if measured.seconds > 0 else 0.0
    p50, p99 = (np.percentile(np.array(measured.latencies) * 1e6, q) if measured.latencies else 0.0 for q in (50, 99))
    return ProtocolRow(label, direction, model, tpb, block_bytes, measured.blocks, _digits(gbps), round(float(p50), 1),
                       round(float(p99), 1), _digits(raw_gbps), _digits(gbps / raw_gbps), None, verified)


def _digits(value: float) -> float:
    return float(f"{value:.4g}")
