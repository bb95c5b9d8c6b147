"""`--suite store --with-compute`: what a connector's saves cost a prefill computing beside them.

Per block size, on fresh engines (as in `protocol_suite`) with the same kind of prompts:
1. a cold round with nothing beside it: the connector's save GB/s alone;
2. a cold round with a connector that does nothing while `MatmulLoad` runs products back to back:
   `ms engine`, the products inside its saving spans (below; every product of the round when
   fewer than `MIN_ENGINE_PRODUCTS` ran there), beside the fake engine's own work only (writing
   and checking KV bytes), which a real engine would not add;
3. the connector's cold round with the products beside it, then a warm round with nothing beside
   it, which proves the bytes saved under load. `ms saving`: the products that ran at least half
   inside the connector's saving spans: per pass, from its first save hook's entry to its last's
   exit (copies a hook queued run between hooks), and each asynchronous save from `SaveStarted` to
   `SaveFinished`.
The products also run alone for a moment before and after round 3 (`ms alone`, their median).
A warm-up that is not counted precedes round 2 and `ms alone`.
`slowdown_during_saves` = `ms saving` / `ms engine` - 1: what the connector's saves cost the
products beyond what the same spans of a connector that does nothing cost them. Not against `ms
alone`: the spans hold engine work too (a pass's later layers), and on an H100 back-to-back
products alone ran up to 13 % slower than the same products beside the engine (0.77-0.88 against
0.74-0.77 ms; -0.3 to +13 % a row), whose pauses let the GPU's clock recover, so a ratio to `ms
alone` read as a speed-up in 8 rows of 12.
`engine_slowdown` = `ms engine` / `ms alone` - 1; `save_ratio_with_compute` = round 3's save GB/s
over round 1's.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from kvtool.bench.compute_load import MatmulLoad, Product, during, median_seconds
from kvtool.bench.protocol_engine import (
    Recorder,
    Workload,
    build_engine,
    check_bytes,
    four_digits,
    measure_round,
    one_line_errors,
    run_round,
    union,
)
from kvtool.connector.api import KvCacheConnectorScheduler, KvCacheConnectorWorker
from kvtool.connector.loader import ConnectorSpec
from kvtool.connector.store_namespace import store_namespace
from kvtool.engine.runtimes import DEFAULT_RUNTIME, RuntimeName

ALONE_SECONDS = 0.3
"""Products alone before and after the loaded round: enough for a stable median on either device."""
MIN_ENGINE_PRODUCTS = 10
"""Products inside the no-op connector's saving spans below which `ms engine` takes the whole round's."""
WARMUP_SECONDS = 0.3
"""Products run and not counted before `ms alone`: an idle GPU's first products run at a lower clock."""


@dataclass
class ComputeRow:
    connector: str
    model: str
    tokens_per_block: int
    products: str
    """What ran beside the connector (`MatmulLoad.describe`)."""
    matmul_ms_alone: float | None
    matmul_ms_during_saves: float | None
    matmul_ms_engine_only: float | None
    slowdown_during_saves: float | None
    """`ms saving` / `ms engine` - 1 (module docstring); None when no product ran at least half
    inside a save (saves shorter than a product)."""
    engine_slowdown: float | None
    products_during_saves: int
    products_dropped: int
    """GPU batches of the whole loaded round (not only its saving spans) left out because their
    stream may have idled waiting for the interpreter (`compute_load`)."""
    save_gbps_with_compute: float
    save_gbps: float
    """The same connector's save in a cold round with nothing beside it, just before."""
    save_ratio_with_compute: float | None
    verified: bool

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class _Loaded:
    """One block size's loaded cold round: product intervals, the round's window, the save spans."""

    products: list[Product]
    dropped: int
    alone: list[Product]
    engine_only: list[Product]
    window: tuple[float, float]
    save_spans: list[tuple[float, float]]
    save_gbps: float
    unloaded_save_gbps: float
    issue: str | None


def run_compute_suite(targets: list[tuple[ConnectorSpec, dict[str, str], str]], model: str,
                      tokens_per_block: list[int], workload: Workload, device: str,
                      rows: list[ComputeRow], runtime: RuntimeName = DEFAULT_RUNTIME) -> list[str]:
    """Append to `rows` a row per (target, block size) for `targets` as (spec, options, label), as
    each is measured (what an error stops keeps those before it); one line per check that failed
    (bytes saved under load not verified). ConnectorError when a hook raised, ComputeLoadError when
    the products failed."""
    load = MatmulLoad(torch.device(device))
    problems = []
    for spec, options, label in targets:
        with store_namespace(label="bench-compute"):
            for tpb in tokens_per_block:
                with one_line_errors(label):
                    loaded = _loaded_round(spec, options, label, model, tpb, workload, device, load, runtime)
                rows.append(_row(label, model, tpb, load, loaded))
                if loaded.issue is not None:
                    problems.append(f"{label}, {tpb} tokens per block, saved beside products: not verified: "
                                    f"{loaded.issue}")
    return problems


def _loaded_round(spec: ConnectorSpec, options: dict[str, str], label: str, model: str, tpb: int,
                  workload: Workload, device: str, load: MatmulLoad, runtime: RuntimeName = DEFAULT_RUNTIME) -> _Loaded:
    unloaded = _cold_save_gbps(spec, options, label, model, tpb, workload, device, runtime)
    engine_only = _engine_only_products(model, tpb, workload, device, load)
    engine = build_engine(spec, options, model, tpb, workload, device, runtime)
    try:
        recorder = Recorder(engine)
        recorder.attach()
        prompts = workload.fresh_prompts(tpb)
        load.run_for(WARMUP_SECONDS)
        alone = load.run_for(ALONE_SECONDS)
        cold, products, window = _beside(load, lambda: run_round(engine, label, prompts, first_id=0))
        dropped = load.dropped
        alone += load.run_for(ALONE_SECONDS)
        warm = run_round(engine, label, prompts, first_id=len(prompts))
        return _Loaded(products, dropped, alone, engine_only, window, _saving_spans(recorder, cold.ids),
                       _save_gbps(engine, recorder, cold, tpb), unloaded, check_bytes(engine, cold, warm))
    finally:
        engine.close()


def _beside(load: MatmulLoad, work):
    """`work()`'s result, the products that ran beside it, and its (start, end) on the host clock;
    what `work` raised wins over what the products raised."""
    load.start()
    started = time.perf_counter()
    try:
        result = work()
    except BaseException:
        load.stop(quiet=True)
        raise
    ended = time.perf_counter()
    return result, load.stop(), (started, ended)


def _engine_only_products(model: str, tpb: int, workload: Workload, device: str, load: MatmulLoad
                          ) -> list[Product]:
    """Products beside a cold round whose connector does nothing, judged against the same saving
    spans (its hooks are timed as any connector's): what the engine's own work in those spans
    costs them. Fewer than `MIN_ENGINE_PRODUCTS` there (a small model's passes are shorter than a
    product: on an H100, tiny's gave none), every product inside the round instead."""
    engine = build_engine(IDLE_CONNECTOR, {}, model, tpb, workload, device)
    try:
        recorder = Recorder(engine)
        recorder.attach()
        load.run_for(WARMUP_SECONDS)
        cold, products, window = _beside(load, lambda: run_round(engine, "no-op", workload.fresh_prompts(tpb), 0))
        return engine_products(products, _saving_spans(recorder, cold.ids), window)
    finally:
        engine.close()


def engine_products(products: list[Product], spans: list[tuple[float, float]], window: tuple[float, float]
                    ) -> list[Product]:
    """The products `ms engine` is the median of: those inside `spans`, or every one inside
    `window` when fewer than `MIN_ENGINE_PRODUCTS` are."""
    inside_spans = during(products, spans, window)
    return inside_spans if len(inside_spans) >= MIN_ENGINE_PRODUCTS else during(products, [window], window)


class _IdleScheduler(KvCacheConnectorScheduler):
    """Offers nothing and saves nothing: the hooks run, empty."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request, block_ids) -> None:
        pass

    def build_connector_meta(self, scheduler_output) -> None:
        return None

    def request_finished(self, request, cache_block_ids) -> bool:
        return False


class _IdleWorker(KvCacheConnectorWorker):
    def register_kv_caches(self, kv_cache_tensor) -> None:
        pass

    def start_load_kv(self, stream) -> None:
        pass

    def wait_for_layer_load(self, layer_idx: int, stream) -> None:
        pass

    def save_kv_layer(self, layer_idx: int, stream) -> None:
        pass

    def wait_for_save(self, stream) -> None:
        pass

    def get_finished(self, finished_gen_req_ids, started_loading_req_ids) -> tuple[list[int], list[int]]:
        return [], []


IDLE_CONNECTOR = ConnectorSpec("no-op", _IdleScheduler, _IdleWorker, __name__)


def _saving_spans(recorder: Recorder, ids: list[int]) -> list[tuple[float, float]]:
    """When the connector may have had saves in flight (module docstring), as disjoint spans."""
    by_pass: dict[int, tuple[float, float]] = {}
    for kind, iteration, start, end in recorder.hooks:
        if kind == "save":
            low, high = by_pass.get(iteration, (start, end))
            by_pass[iteration] = (min(low, start), max(high, end))
    asynchronous = [(recorder.save_start[i], recorder.async_end.get(("save", i), recorder.save_start[i]))
                    for i in ids if i in recorder.save_start]
    return union(list(by_pass.values()) + asynchronous)


def _cold_save_gbps(spec: ConnectorSpec, options: dict[str, str], label: str, model: str, tpb: int,
                    workload: Workload, device: str, runtime: RuntimeName = DEFAULT_RUNTIME) -> float:
    """Save GB/s of a cold round on a fresh engine with nothing beside it."""
    engine = build_engine(spec, options, model, tpb, workload, device, runtime)
    try:
        recorder = Recorder(engine)
        recorder.attach()
        return _save_gbps(engine, recorder, run_round(engine, label, workload.fresh_prompts(tpb), first_id=0), tpb)
    finally:
        engine.close()


def _save_gbps(engine, recorder: Recorder, cold, tpb: int) -> float:
    saves = measure_round(recorder, cold, "save", tpb)
    nbytes = saves.blocks * engine.manager.layout.bytes_per_block
    return nbytes / saves.seconds / 1e9 if saves.seconds > 0 else 0.0


def _row(label: str, model: str, tpb: int, load: MatmulLoad, loaded: _Loaded) -> ComputeRow:
    saving = during(loaded.products, loaded.save_spans, loaded.window)
    beside_saves, alone, engine_only = (median_seconds(p) for p in (saving, loaded.alone, loaded.engine_only))
    ratio = four_digits(loaded.save_gbps / loaded.unloaded_save_gbps) if loaded.unloaded_save_gbps else None
    return ComputeRow(label, model, tpb, load.describe(), _ms(alone), _ms(beside_saves), _ms(engine_only),
                      _slowdown(beside_saves, engine_only), _slowdown(engine_only, alone),
                      len(saving), loaded.dropped,
                      four_digits(loaded.save_gbps), four_digits(loaded.unloaded_save_gbps), ratio,
                      loaded.issue is None)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else four_digits(seconds * 1e3)


def _slowdown(loaded: float | None, baseline: float | None) -> float | None:
    return None if loaded is None or not baseline else round(loaded / baseline - 1, 4)
