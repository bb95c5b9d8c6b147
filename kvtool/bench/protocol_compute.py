"""`--suite store --with-compute`: what a connector's saves cost a prefill computing beside them.

Per block size, a fresh engine (as in `protocol_suite`) runs the cold round while `MatmulLoad`
runs products back to back, then a warm round with nothing beside it, which proves the bytes saved
under load. The products run alone for a moment before and after the cold round (their median is
`matmul_ms_alone`). Of the products inside the cold round:
- `during saves`: at least half their interval inside the connector's save intervals (the union
  of every request's, as `protocol_engine` times them);
- `engine only`: none of it inside them: the fake engine's own work (writing and checking KV
  bytes), which a real engine would not add; reported so that its share can be told apart.
`slowdown_during_saves` = their median product time / the alone median - 1. The save's own GB/s
under load is set against a cold round of a fresh engine with nothing beside it, run just before
(so both pay the same warm-up: a first engine in a process pays for touching fresh memory).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from kvtool.bench.compute_load import MatmulLoad, Product, median_seconds, split
from kvtool.bench.protocol_engine import (Recorder, Workload, build_engine, check_bytes, four_digits, measure_round,
                                          one_line_errors, run_round, union)
from kvtool.connector.loader import ConnectorSpec
from kvtool.connector.store_namespace import store_namespace

ALONE_SECONDS = 0.3
"""Products alone before and after the loaded round: enough for a stable median on either device."""


@dataclass
class ComputeRow:
    connector: str
    model: str
    tokens_per_block: int
    products: str
    """What ran beside the connector (`MatmulLoad.describe`)."""
    matmul_ms_alone: float
    matmul_ms_during_saves: float | None
    matmul_ms_engine_only: float | None
    slowdown_during_saves: float | None
    """None when no product ran at least half inside a save (saves shorter than a product)."""
    engine_slowdown: float | None
    products_during_saves: int
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
    alone: list[Product]
    window: tuple[float, float]
    save_spans: list[tuple[float, float]]
    save_gbps: float
    unloaded_save_gbps: float
    issue: str | None


def run_compute_suite(targets: list[tuple[ConnectorSpec, dict[str, str], str]], model: str,
                      tokens_per_block: list[int], workload: Workload, device: str
                      ) -> tuple[list[ComputeRow], list[str]]:
    """A row per (target, block size) for `targets` as (spec, options, label), and one line per
    check that failed (bytes saved under load not verified). ConnectorError when a hook raised."""
    load = MatmulLoad(torch.device(device))
    rows, problems = [], []
    for spec, options, label in targets:
        with store_namespace(label="bench-compute"):
            for tpb in tokens_per_block:
                with one_line_errors(label):
                    loaded = _loaded_round(spec, options, label, model, tpb, workload, device, load)
                rows.append(_row(label, model, tpb, load, loaded))
                if loaded.issue is not None:
                    problems.append(f"{label}, {tpb} tokens per block, saved beside products: not verified: "
                                    f"{loaded.issue}")
    return rows, problems


def _loaded_round(spec: ConnectorSpec, options: dict[str, str], label: str, model: str, tpb: int,
                  workload: Workload, device: str, load: MatmulLoad) -> _Loaded:
    unloaded = _cold_save_gbps(spec, options, label, model, tpb, workload, device)
    engine = build_engine(spec, options, model, tpb, workload, device)
    try:
        recorder = Recorder(engine)
        recorder.attach()
        prompts = _prompts(workload, tpb)
        alone = load.run_for(ALONE_SECONDS)
        load.start()
        started = time.perf_counter()
        try:
            cold = run_round(engine, label, prompts, first_id=0)
        finally:
            ended = time.perf_counter()
            products = load.stop()
        alone += load.run_for(ALONE_SECONDS)
        warm = run_round(engine, label, prompts, first_id=len(prompts))
        spans = union([span for i in cold.ids for span in recorder.intervals("save", i)])
        return _Loaded(products, alone, (started, ended), spans, _save_gbps(engine, recorder, cold, tpb), unloaded,
                       check_bytes(engine, cold, warm))
    finally:
        engine.close()


def _cold_save_gbps(spec: ConnectorSpec, options: dict[str, str], label: str, model: str, tpb: int,
                    workload: Workload, device: str) -> float:
    """Save GB/s of a cold round on a fresh engine with nothing beside it."""
    engine = build_engine(spec, options, model, tpb, workload, device)
    try:
        recorder = Recorder(engine)
        recorder.attach()
        return _save_gbps(engine, recorder, run_round(engine, label, _prompts(workload, tpb), first_id=0), tpb)
    finally:
        engine.close()


def _save_gbps(engine, recorder: Recorder, cold, tpb: int) -> float:
    saves = measure_round(recorder, cold, "save", tpb)
    nbytes = saves.blocks * engine.manager.layout.bytes_per_block
    return nbytes / saves.seconds / 1e9 if saves.seconds > 0 else 0.0


def _prompts(workload: Workload, tpb: int) -> list[list[int]]:
    """Fresh random prompts: a store that outlives the engine (files, a server) starts cold."""
    return workload.token_lists(tpb, np.random.default_rng(int.from_bytes(os.urandom(8), "little")))


def _row(label: str, model: str, tpb: int, load: MatmulLoad, loaded: _Loaded) -> ComputeRow:
    parts = split(loaded.products, loaded.save_spans, loaded.window)
    alone = median_seconds(loaded.alone)
    during, outside = median_seconds(parts.during), median_seconds(parts.outside)
    ratio = four_digits(loaded.save_gbps / loaded.unloaded_save_gbps) if loaded.unloaded_save_gbps else None
    return ComputeRow(label, model, tpb, load.describe(), _ms(alone), _ms(during), _ms(outside),
                      _slowdown(during, alone), _slowdown(outside, alone), len(parts.during),
                      four_digits(loaded.save_gbps), four_digits(loaded.unloaded_save_gbps), ratio, loaded.issue is None)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else four_digits(seconds * 1e3)


def _slowdown(loaded: float | None, alone: float | None) -> float | None:
    return None if loaded is None or not alone else round(loaded / alone - 1, 4)
