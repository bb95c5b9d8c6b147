"""What `trace run` and `trace sweep` share: reading the workload options into a `Replay` (the
workload, the engine config, the connector) with every check done before any work."""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvtool.blocks import ceil_div
from kvtool.inputs import connector_options, manager_config, parse_options
from kvtool.connector.loader import ConnectorSpec
from kvtool.connector.options import declared_options
from kvtool.connector.request import max_kv_tokens
from kvtool.connectors.registry import load_connector
from kvtool.trace.cost_model import H200_BF16_TFLOPS, H200_LOAD_GBPS, CostModel, cost_model_for
from kvtool.engine.engine import EngineConfig
from kvtool.engine.runtimes import DEFAULT_RUNTIME, runtime_name
from kvtool.engine.ranks import rank_manager_config
from kvtool.engine.scheduler import SchedulerConfig
from kvtool.errors import InputError, OutOfMemoryError
from kvtool.manager.config import KvCacheManagerConfig
from kvtool.manager.layer_groups import plan_layer_groups
from kvtool.manager.manager import compute_layout, default_device, plan_num_slots
from kvtool.manager.pool_groups import pages_per_pool_group, plan_pool_groups
from kvtool.manager.storage import memory_shortfall
from kvtool.report.bench_report import bench_rate
from kvtool.units import format_size, parse_size
from kvtool.workloads.source import RequestSize, Workload, open_workload

DEFAULT_NUM_SLOTS = 1024
"""Pool slots for kvtool workloads (the shipped ones are small)."""
DEFAULT_GPU_TOKENS_IMPORTED = 524_288
"""KV tokens the GPU pool holds for imported traces: about what an H200 keeps for an 8B model
after its weights (64 GiB of bf16 KV at 128 KiB a token)."""


@dataclass(frozen=True)
class Replay:
    workload: Workload
    config: EngineConfig
    connector: ConnectorSpec | None
    options: dict[str, str]
    cost_model: CostModel | None
    load_rate_note: str | None = None
    """Where --bandwidth-from took the load rate, in words (and how that row differs from the replay)."""
    load_rate_source: dict | None = None
    """The same for meta.json."""

    @property
    def is_imported(self) -> bool:
        return self.workload.format != "kvtool"


@dataclass(frozen=True)
class ReplayOptions:
    """The command-line values; None where the user left a default that depends on the format."""

    workload: Path
    trace_format: str | None = None
    source_block_size: int | None = None
    prefill_only: bool = False
    fidelity: str | None = None
    model: str | None = None
    tokens_per_block: int = 32
    num_slots: int | None = None
    gpu_memory: str | None = None
    max_batch_size: int = 64
    max_num_tokens: int = 8192
    chunk_size: int | None = None
    connector: str = "none"
    connector_dir: Path | None = None
    connector_opt: tuple[str, ...] = ()
    compat: str | None = None
    """`--compat`: the modules a connector written against another runtime imports."""
    no_local_reuse: bool = False
    admission: str = "reserve"
    runtime: str = str(DEFAULT_RUNTIME)
    """The TensorRT-LLM runtime the engine plays (`kvtool.engine.runtimes`)."""
    seed: int = 0
    num_ranks: int = 1
    tp: int = 1
    cost_model: bool | None = None
    tflops: float = H200_BF16_TFLOPS
    load_gbps: float = H200_LOAD_GBPS
    bandwidth_from: Path | None = None
    """A kvtool bench run folder: its load GB/s at `tokens_per_block` replaces `load_gbps`, and
    turns the cost model on (the rate means nothing without it)."""
    params: float | None = None
    attention_width: int | None = None
    draft_tokens: int = 0
    acceptance: float = 0.7


def build_replay(o: ReplayOptions) -> Replay:
    """The replay the options describe; InputError for anything that cannot run."""
    for name, value in (("max-batch-size", o.max_batch_size), ("max-num-tokens", o.max_num_tokens),
                        ("chunk-size", o.chunk_size), ("num-ranks", o.num_ranks), ("tp", o.tp),
                        ("tokens-per-block", o.tokens_per_block)):
        if value is not None and value <= 0:
            raise InputError(f"--{name} must be positive, got {value}")
    if o.draft_tokens < 0:
        raise InputError(f"--draft-tokens must be 0 or more, got {o.draft_tokens}")
    if not 0.0 <= o.acceptance <= 1.0:
        raise InputError(f"--acceptance is a probability: between 0 and 1, got {o.acceptance}")
    workload = open_workload(o.workload, o.trace_format, o.source_block_size, o.prefill_only)
    imported = workload.format != "kvtool"
    fidelity = o.fidelity or ("blocks" if imported else "bytes")
    model = o.model or ("llama-3.1-8b" if imported else "tiny")
    num_slots = o.num_slots
    if num_slots is None and o.gpu_memory is None:
        num_slots = ceil_div(DEFAULT_GPU_TOKENS_IMPORTED, o.tokens_per_block) if imported else DEFAULT_NUM_SLOTS
    manager = manager_config(model, o.tokens_per_block, None, o.gpu_memory, num_slots)
    spec = None if o.connector == "none" else load_connector(o.connector, o.compat)
    if o.connector_dir is not None and spec is None:
        raise InputError("--connector-dir is the disk connector's folder: give --connector disk")
    options = connector_options(spec, list(o.connector_opt), o.connector_dir) if spec else \
        parse_options(list(o.connector_opt))
    if options and spec is None:
        raise InputError("--connector-opt needs a --connector")
    rate = None
    if o.bandwidth_from is not None:
        if o.cost_model is False:
            raise InputError("--bandwidth-from sets the cost model's load rate: it cannot go with --no-cost-model")
        rate = bench_rate(o.bandwidth_from, "load", o.tokens_per_block, manager.model.name)
        o = replace(o, load_gbps=rate.gbps, cost_model=True)
    cost = _cost_model(o, manager, spec, options, imported)
    config = EngineConfig(manager, SchedulerConfig(o.max_batch_size, o.max_num_tokens, o.chunk_size,
                                                   local_reuse=not o.no_local_reuse,
                                                   **_admission(o.admission)),
                          seed=o.seed, runtime=runtime_name(o.runtime), num_ranks=o.num_ranks, tp_size=o.tp,
                          ranks_as_processes=True,
                          fidelity=fidelity, iteration_time=cost.iteration_seconds if cost else None,
                          draft_tokens=o.draft_tokens, acceptance=o.acceptance)
    return Replay(workload, config, spec, options, cost,
                  rate.describe(o.tokens_per_block, manager.model.name) if rate else None,
                  rate.as_dict() if rate else None)


ADMISSIONS = {"reserve": dict(reserve_outputs=True), "greedy": dict(),
              "max-utilization": dict(pause_to_grow=True)}
"""--admission NAME -> the SchedulerConfig fields it sets."""


def _admission(admission: str) -> dict[str, bool]:
    if admission not in ADMISSIONS:
        raise InputError(f"--admission must be one of {', '.join(ADMISSIONS)}, got {admission!r}")
    return ADMISSIONS[admission]


def _cost_model(o: ReplayOptions, manager, spec: ConnectorSpec | None, options: dict[str, str],
                imported: bool) -> CostModel | None:
    """The cost model: on by default for imported traces, off (10 ms an iteration) for kvtool ones."""
    if not (o.cost_model if o.cost_model is not None else imported):
        return None
    per_token = block_bytes(manager) // manager.tokens_per_block
    layerwise = (options.get("mode") or (spec.options.get("mode") if spec else None)) == "layerwise"
    return cost_model_for(manager.model, per_token, o.params, o.attention_width, o.tflops, o.load_gbps, layerwise)


def block_bytes(manager) -> int:
    """Bytes of one block over every layer group (what a connector stores per block)."""
    return compute_layout(replace(manager, num_slots=1, memory_bytes=None)).bytes_per_block


# ---- the cache holds the workload: checked before any replay -------------------------------------
# The engine refuses a request that cannot fit even an empty cache when the request arrives, which
# in a long replay is minutes in. The workload is scanned once up front instead (`request_sizes`: a
# JSON decode per line, no request built, an imported trace's tokens not synthesized), with the
# engine's own measure of a request (`max_kv_tokens`, `pages_per_pool_group`).

def check_before_replay(replay: Replay) -> None:
    """Every check a replay can fail at its start, made before it starts: the pools fit the
    machine, the cache holds the workload's largest request."""
    check_pools_fit_memory(replay)
    check_cache_holds(replay, workload_sizes(replay.workload))


DECODE_CHECK_BYTES_PER_S = 175e6
"""KV bytes a second the fake engine checks on decode steps, measured on this repository's 2-core
CI machine (tiny, the first 12 requests of the shipped Mooncake slice: 89 M positions read by
decode steps, 45.6 GB checked, 260 s; the same requests with --prefill-only took 3 s)."""
DECODE_NOTE_SECONDS = 120


def decode_check_note(replay: Replay) -> str | None:
    """A line saying what a bytes-fidelity replay's decode steps will cost when that is more than
    a couple of minutes: every decode step of a request checks every position it attends to, its
    whole context, so long prompts with long answers grow as prompt x answer."""
    if replay.config.fidelity != "bytes":
        return None
    positions = sum(s.max_new_tokens * (s.prompt_len + s.max_new_tokens / 2)
                    for s in replay.workload.request_sizes())
    per_token = block_bytes(replay.config.manager) // replay.config.manager.tokens_per_block
    seconds = positions * per_token / DECODE_CHECK_BYTES_PER_S
    if seconds < DECODE_NOTE_SECONDS:
        return None
    return (f"bytes fidelity checks every KV byte a pass reads: this workload's decode steps read {positions:.3g} "
            f"positions ({format_size(int(positions * per_token))}), about {_duration(seconds)} at the "
            f"{DECODE_CHECK_BYTES_PER_S / 1e6:.0f} MB/s a 2-core machine checks; --prefill-only leaves decode out, "
            "--fidelity blocks moves no bytes")


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} hours" if seconds >= 5400 else f"{seconds / 60:.0f} minutes"


def workload_sizes(workload: Workload) -> dict[int, RequestSize]:
    """The first request of each size its KV cache can grow to (tokens, `max_kv_tokens`)."""
    sizes: dict[int, RequestSize] = {}
    for size in workload.request_sizes():
        sizes.setdefault(max_kv_tokens(size.prompt_len, size.max_new_tokens), size)
    return sizes


def check_cache_holds(replay: Replay, sizes: dict[int, RequestSize]) -> None:
    """InputError when the cache of `replay` cannot hold the largest request of `sizes` even empty,
    saying the smallest --num-slots and --gpu-memory that can."""
    manager = rank_manager_config(replay.config.manager, replay.config.tp_size, 0)
    needs = _pages_needed(manager, sizes)
    have = plan_num_slots(manager)
    short = [(need - slots, pg, need, slots, size) for pg, ((need, size), slots) in enumerate(zip(needs, have))
             if need > slots]
    if not short:
        return
    _, pg, need, slots, size = max(short, key=lambda s: s[:2])
    smallest = max(n for n, _ in needs)
    raise InputError(f"the KV cache is too small: request {size.request_id} ({size.prompt_len} prompt + "
                     f"{size.max_new_tokens} new tokens) needs {need} pages in pool group {pg}, which has {slots} "
                     f"({replay.workload.path} line {size.line}); the smallest cache that holds every request of "
                     f"the workload: --num-slots {smallest} or --gpu-memory "
                     f"{_smallest_memory(manager, [n for n, _ in needs])}")


def _pages_needed(manager: KvCacheManagerConfig, sizes: dict[int, RequestSize]) -> list[tuple[int, RequestSize]]:
    """Per pool group: the most pages one request needs, and that request."""
    groups = plan_layer_groups(manager.model, manager.tokens_per_block)
    pool_groups = plan_pool_groups(groups)
    best: list[tuple[int, RequestSize | None]] = [(0, None)] * len(pool_groups)
    for tokens, size in sizes.items():
        for pg, need in enumerate(pages_per_pool_group(groups, pool_groups, tokens, manager.tokens_per_block)):
            if need > best[pg][0]:
                best[pg] = (need, size)
    return best  # type: ignore[return-value]


def _smallest_memory(manager: KvCacheManagerConfig, needs: list[int]) -> str:
    """The smallest --gpu-memory (as text it reads back) whose pools have `needs` slots or more."""
    def holds(num_bytes: int) -> bool:
        try:
            slots = plan_num_slots(replace(manager, num_slots=None, num_slots_by_pool_group=None,
                                           memory_bytes=num_bytes))
        except OutOfMemoryError:
            return False
        return all(s >= n for s, n in zip(slots, needs))

    low, high = 0, 1 << 20
    while not holds(high):
        low, high = high, high * 2
    while high - low > max(high >> 12, 1):
        middle = (low + high) // 2
        low, high = (low, middle) if holds(middle) else (middle, high)
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if high >= scale:
            step = 100 if unit != "KiB" else 1
            text = f"{-(-high * step // scale) / step:g}{unit}"
            return text if parse_size(text) >= high else f"{-(-high // scale)}{unit}"
    return f"{high}B"


def check_pools_fit_memory(replay: Replay) -> None:
    """OutOfMemoryError, naming this command's options, when a bytes-fidelity replay's pools would
    not fit where they are allocated (block fidelity allocates none)."""
    if replay.config.fidelity != "bytes":
        return
    manager = rank_manager_config(replay.config.manager, replay.config.tp_size, 0)
    layout = compute_layout(manager)
    device = torch.device(manager.device) if manager.device else default_device()
    shortfall = memory_shortfall(sum(pg.slot_bytes * pg.num_slots for pg in layout.pool_groups), device)
    if shortfall:
        raise OutOfMemoryError(f"the KV pools do not fit: {shortfall}: lower --gpu-memory or --num-slots")


def note_store_folder(replay: Replay) -> None:
    """One line on stderr naming the folder a connector writes to when it was left to its default
    (the disk connector's ./kvtool-disk-cache): a folder appearing in the working directory unasked
    is a surprise, and one shared by every later run that leaves it out too."""
    if replay.connector is None or "dir" in replay.options:
        return
    option = next((o for o in declared_options(replay.connector.scheduler_class) or () if o.name == "dir"), None)
    if option is not None and option.default:
        print(f"kvtool: connector {replay.connector.name} writes to {Path(option.default).resolve()} (its default "
              "folder; choose one with --connector-dir DIR)", file=sys.stderr)
