"""Driving a connector through the engine for the protocol benches: the workload, the rounds, and
what the engine shows of the connector's loads and saves on the host's clock (`Recorder`).

A round runs its prompts as new requests, `Workload.per_pass` a pass, to completion. Timing: the
wall clock inside the worker's hooks, on the engine's iteration. A request's load is the time inside
`start_load_kv` and `wait_for_layer_load` in the pass that delivered it (an asynchronous load: from
its `LoadStarted` event to its `LoadFinished`); its save is the time inside `save_kv_layer` and
`wait_for_save` in the pass that computed it (plus, for an asynchronous save, `SaveStarted` to
`SaveFinished`).

Whose time it is: on GPU pages, before a timed worker hook's clock starts, the host waits for the
fake engine's work queued on the forward stream (an event recorded after each layer's forward;
before `start_load_kv`, the whole stream), so a hook's time never includes the fingerprint writes
a save must wait for anyway, while work the connector itself queued on that stream after them still
counts as its own; that wait is the runtime's. Per round, the connector's time is every call into
it (scheduler and worker hooks, less those waits) plus the engine's idle waits for its background
copies (`Engine.idle_for_connector`), and the runtime's is the rest of the round's wall time
(scheduling, the manager, the fake forward and its byte checks): what a connector author can make
faster is the first.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from kvtool.connector.loader import ConnectorSpec
from kvtool.connector.request import Request
from kvtool.engine.engine import Engine, EngineConfig
from kvtool.engine.events import Deliver, Finished, LoadFinished, LoadStarted, PassDone, SaveFinished, SaveStarted
from kvtool.engine.fake_engine import VOCAB_SIZE
from kvtool.engine.runtimes import DEFAULT_RUNTIME, RuntimeName, profile_of
from kvtool.engine.scheduler import SchedulerConfig
from kvtool.errors import ConnectorError, KvToolError
from kvtool.manager import KvCacheManagerConfig
from kvtool.models import load_model

LOAD_HOOKS = ("start_load_kv", "wait_for_layer_load")
SAVE_HOOKS = ("save_kv_layer", "wait_for_save")


@dataclass(frozen=True)
class Workload:
    """N prompts of K full blocks each (plus half a block the connector never sees whole), at most
    `per_pass` of them in one pass (TensorRT-LLM's max batch size). By default a round's prompts
    share one pass, as a serving engine's batch does: a connector that batches a pass's copies
    moves them at the link (results/protocol-store-bench: one prompt a pass paid the per-pass
    costs eight times over)."""

    prompts: int = 8
    blocks: int = 16
    per_pass: int = 8

    def fresh_prompts(self, tokens_per_block: int) -> list[list[int]]:
        """Random prompts, never drawn before: a store that outlives its engine (files, a server)
        finds none of them, so every round starts cold."""
        rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))
        length = self.blocks * tokens_per_block + max(1, tokens_per_block // 2)
        return [rng.integers(0, VOCAB_SIZE, length).tolist() for _ in range(self.prompts)]


QUICK = Workload(prompts=4, blocks=4)


@dataclass
class Recorder:
    """What one engine's run shows of its requests' loads and saves: worker hook intervals
    `(kind, iteration, start, end)` and the events, wall-clocked (request ids and iterations never
    repeat, so one recorder serves both rounds)."""

    event_kinds: ClassVar[frozenset] = frozenset({PassDone, LoadStarted, LoadFinished, SaveStarted, SaveFinished,
                                                  Deliver, Finished})
    engine: Engine
    hooks: list[tuple[str, int, float, float]] = field(default_factory=list)
    connector_seconds: float = 0.0
    """Inside any call into the connector so far (the runtime's `around_hook`), less `runtime_waits`."""
    runtime_waits: float = 0.0
    """Waiting, before timed worker hooks, for the GPU work the engine had queued."""
    _forward_done: torch.cuda.Event | None = None
    """The CUDA event recorded after the last layer's fake forward (GPU pages)."""
    computed_in: dict[int, int] = field(default_factory=dict)
    load_start: dict[int, tuple[int, float, bool]] = field(default_factory=dict)
    async_end: dict[tuple[str, int], float] = field(default_factory=dict)
    save_start: dict[int, float] = field(default_factory=dict)
    finished: dict[int, Finished] = field(default_factory=dict)
    delivered: dict[int, int] = field(default_factory=dict)
    _started: dict[tuple[str, int], float] = field(default_factory=dict)
    """When each load or save hook now running started, by (hook, rank)."""

    def attach(self) -> None:
        """Subscribe to the engine's events, clock every call into the connector and observe every
        worker's load and save hooks (through the pass driver)."""
        self.engine.events.subscribe(self)
        connector = self.engine.connector
        assert connector is not None   # the bench runs engines with a connector
        connector.around_hook = self._clocked(connector.around_hook)
        # this engine's idle waits for the connector's copies, clocked as the connector's (wrapped on purpose)
        self.engine.idle_for_connector = self._clocked_call(  # type: ignore[method-assign]
            self.engine.idle_for_connector)
        self._mark_forward_layers(self.engine.driver)
        self.engine.driver.observe(self)

    def _clocked(self, outer):
        """`outer` (a context manager factory) clocked as the connector's."""
        @contextlib.contextmanager
        def clocked() -> Iterator[None]:
            start = time.perf_counter()
            try:
                with outer():
                    yield
            finally:
                self.connector_seconds += time.perf_counter() - start
        return clocked

    def _clocked_call(self, call):
        """`call` (no arguments) clocked as the connector's."""
        clocked = self._clocked(contextlib.nullcontext)

        def run() -> None:
            with clocked():
                call()
        return run

    def _mark_forward_layers(self, driver) -> None:
        """Record an event after each layer's fake forward on a CUDA forward stream: what a timed
        hook waits for before its clock starts (the runtime's work, not the connector's)."""
        if not isinstance(driver.stream, torch.cuda.Stream):
            return

        def layer_done(layer_id: int) -> None:
            self._forward_done = torch.cuda.Event()
            self._forward_done.record(driver.stream)
        driver.observe_layers(layer_done)

    def connector_time(self) -> float:
        return self.connector_seconds - self.runtime_waits

    def _wait_for_the_runtime(self, hook: str, args: tuple) -> None:
        """Wait for the fake engine's queued work (GPU pages only), on the runtime's clock: up to
        the last layer's forward, or before `start_load_kv` the whole forward stream it is given."""
        stream = args[-1] if args else None
        if not isinstance(stream, torch.cuda.Stream):
            return
        start = time.perf_counter()
        if hook == "start_load_kv" or self._forward_done is None:
            stream.synchronize()
        else:
            self._forward_done.synchronize()
        self.runtime_waits += time.perf_counter() - start

    def before(self, hook: str, rank: int, args: tuple) -> None:
        """A `HookObserver`'s: a load or save hook's clock starts once the runtime's work is done."""
        if hook in LOAD_HOOKS + SAVE_HOOKS:
            self._wait_for_the_runtime(hook, args)
            self._started[hook, rank] = time.perf_counter()

    def after(self, hook: str, rank: int) -> None:
        if hook in LOAD_HOOKS + SAVE_HOOKS:
            kind = "load" if hook in LOAD_HOOKS else "save"
            self.hooks.append((kind, self.engine.iteration, self._started.pop((hook, rank)), time.perf_counter()))

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
    connector_seconds: float = 0.0
    """The round's time inside the connector (module docstring)."""
    round_seconds: float = 0.0
    """The round's wall time."""


def build_engine(spec: ConnectorSpec | None, options: dict[str, str], model: str, tpb: int, workload: Workload,
                 device: str, runtime: RuntimeName = DEFAULT_RUNTIME) -> Engine:
    """`workload.per_pass` requests per pass, no local prefix reuse (the warm round must ask the connector), pages
    poisoned when handed out (a load that writes nothing reads as wrong bytes), and room for every
    prompt at once (asynchronous loads and saves hold pages outside the batch) plus a spare page;
    under `runtime`, with the admission it runs a connector under."""
    slots = workload.prompts * (workload.blocks + 1) + 1
    manager = KvCacheManagerConfig(load_model(model), tpb, num_slots=slots, device=device, poison_new_pages=True)
    tokens = workload.per_pass * (workload.blocks + 1) * tpb     # room for a whole batch in one prefill
    scheduler = SchedulerConfig(max_batch_size=workload.per_pass, max_num_tokens=max(tokens, 8192), local_reuse=False,
                                reserve_outputs=profile_of(runtime).reserves_outputs)
    config = EngineConfig(manager, scheduler, runtime=runtime, max_transmission_seconds=60.0)
    engine = Engine(config, spec, sized_store(spec, options, model, tpb, workload) if spec else options)
    commit_stores(rank.worker for rank in engine.driver.workers)
    return engine


def sized_store(spec: ConnectorSpec, options: dict[str, str], model: str, tpb: int,
                workload: Workload) -> dict[str, str]:
    """`options`, with a `capacity` that holds a whole round for kvtool's host connector when none
    was given: its 256 MiB default holds 64 blocks of llama-3.1-8b at 32 tokens a block, and the
    warm round would then load half its prompts (a bench of the store's LRU, not of its copies)."""
    from kvtool.connectors.host import HostConnectorScheduler
    if not issubclass(spec.scheduler_class, HostConnectorScheduler) or "capacity" in {**spec.options, **options}:
        return options
    return {**options, "capacity": str(workload.prompts * (workload.blocks + 1) * block_bytes(model, tpb))}


def block_bytes(model: str, tpb: int) -> int:
    """Bytes of one block of `model` at `tpb` tokens a block, every layer group's page."""
    from kvtool.manager import KvCacheManager, KvCacheManagerConfig
    from kvtool.models import load_model
    config = KvCacheManagerConfig(load_model(model), tpb, num_slots=1, device="cpu")
    return KvCacheManager(config).layout.bytes_per_block


def commit_stores(workers: Iterable) -> None:
    """Have every worker that can (kvtool's host connector: `commit_store`) write its whole store
    before anything is timed: its pages are otherwise committed by the first save into each, and
    a benchmark would time page faults instead of copies."""
    for worker in workers:
        commit = getattr(worker, "commit_store", None)
        if commit is not None:
            commit()


@dataclass
class Round:
    ids: list[int]
    tokens: list[list[int]]
    """Generated tokens per request, in prompt order."""
    seconds: float = 0.0
    """Wall time, adding the requests to the last pass."""
    connector_seconds: float = 0.0
    """Of which inside the connector (a `Recorder`'s; 0 without one)."""


def run_round(engine: Engine, label: str, prompts: list[list[int]], first_id: int,
              recorder: Recorder | None = None) -> Round:
    """Run `prompts` as new requests (ids from `first_id`) to completion; ConnectorError, in one
    line, when a hook raised or a request failed."""
    ids = list(range(first_id, first_id + len(prompts)))
    start, in_connector = time.perf_counter(), recorder.connector_time() if recorder else 0.0
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(Request(request_id, prompt, max_new_tokens=1))
    engine.run()
    seconds = time.perf_counter() - start
    in_connector = recorder.connector_time() - in_connector if recorder else 0.0
    connector = engine.connector
    assert connector is not None   # the bench runs engines with a connector
    if connector.failures:
        raise ConnectorError(_one_line(f"connector {label}: {connector.failures[0].describe()}"))
    if engine.stats.failures:                   # e.g. an asynchronous load never reported
        raise ConnectorError(_one_line(f"connector {label}: {engine.stats.failures[0]}"))
    return Round(ids, [engine.states[i].request.generated_token_ids for i in ids], seconds, in_connector)


def _one_line(text: str) -> str:
    return " ".join(text.split())


@contextlib.contextmanager
def one_line_errors(label: str) -> Iterator[None]:
    """A kvtool error keeps its kind (so its exit code) in one line; anything else raised on the
    way (from the connector's code) becomes a ConnectorError naming the connector."""
    try:
        yield
    except KvToolError as exc:
        raise type(exc)(_one_line(str(exc))) from None
    except Exception as exc:  # noqa: BLE001 - the connector's failure, said in one line
        raise ConnectorError(_one_line(f"connector {label}: the run stopped: {type(exc).__name__}: {exc}")) from None


def measure_round(recorder: Recorder, round_: Round, kind: str, tpb: int) -> Measured:
    """Blocks, seconds and per-request seconds of the round's loads or saves (module docstring)."""
    if kind == "load":
        ids = [i for i in round_.ids if recorder.delivered.get(i, 0) > 0 and i in recorder.load_start]
        blocks = sum(math.ceil(recorder.delivered[i] / tpb) for i in ids)
    else:
        ids = round_.ids
        blocks = sum(computed_blocks(recorder.finished[i], tpb) for i in ids if i in recorder.finished)
    spans = {i: recorder.intervals(kind, i) for i in ids}
    latencies = [sum(e - s for s, e in union(spans[i])) for i in ids]
    total = sum(e - s for s, e in union([s for i in ids for s in spans[i]]))
    return Measured(blocks, total, latencies, round_.connector_seconds, round_.seconds)


def computed_blocks(event: Finished, tpb: int) -> int:
    """Full prompt blocks the engine computed (not served from a cache): what a connector saves."""
    return event.prompt_len // tpb - (event.num_local_hit + event.num_external) // tpb


def union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def check_bytes(engine: Engine, cold: Round, warm: Round) -> str | None:
    """None when every byte read was right and every warm request generated the cold one's tokens."""
    if engine.integrity_errors:
        first = engine.fake.issues[0].describe() if engine.fake.issues else ""
        return f"{engine.integrity_errors} integrity error(s) in the KV bytes ({first})"
    differ = [i for i, (a, b) in enumerate(zip(cold.tokens, warm.tokens, strict=True)) if a != b]
    if differ:
        return f"{len(differ)} of {len(cold.tokens)} warm prompts generated other tokens than cold"
    return None


def four_digits(value: float) -> float:
    """`value` to four significant digits, as every bench row reports rates."""
    return float(f"{value:.4g}")


@contextlib.contextmanager
def scratch_working_folder() -> Iterator[Path]:
    """Run in a new temporary folder, removed afterwards with whatever a connector wrote there
    (a store in `./connector_cache`, say): a bench leaves nothing in the user's folder, as a
    validate run keeps each scenario's files in a folder of its own."""
    here = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="kvtool-bench-") as scratch:
        os.chdir(scratch)
        try:
            yield Path(scratch)
        finally:
            os.chdir(here)
