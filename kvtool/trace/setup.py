"""What `trace run` and `trace sweep` share: reading the workload options into a `Replay` (the
workload, the engine config, the connector) with every check done before any work."""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvtool.blocks import ceil_div
from kvtool.connector.loader import ConnectorSpec
from kvtool.connector.options import declared_options
from kvtool.connector.request import max_kv_tokens
from kvtool.connectors.registry import load_connector
from kvtool.engine.engine import EngineConfig
from kvtool.engine.fidelity import parse_fidelity
from kvtool.engine.ranks import rank_manager_config
from kvtool.engine.runtimes import DEFAULT_RUNTIME, runtime_name
from kvtool.engine.runtimes.names import VLLM_RUNTIME
from kvtool.engine.scheduler import SchedulerConfig
from kvtool.errors import InputError, OutOfMemoryError
from kvtool.inputs import connector_options, manager_config, parse_options
from kvtool.manager.config import KvCacheManagerConfig
from kvtool.manager.layer_groups import plan_layer_groups
from kvtool.manager.manager import compute_layout, default_device, plan_num_slots
from kvtool.manager.pool_groups import pages_per_pool_group, plan_pool_groups
from kvtool.manager.storage import memory_shortfall
from kvtool.models import load_model
from kvtool.report.bench_report import bench_rate
from kvtool.trace.cost_model import CostModel, cost_model_for
from kvtool.trace.gpu_pool import GpuPool, gpu_pool
from kvtool.trace.gpus import GpuSpec, gpu_named
from kvtool.trace.model_compute import model_compute
from kvtool.types import Admission, Fidelity
from kvtool.units import format_size, parse_capacity, parse_size
from kvtool.workloads.source import RequestSize, Workload, open_workload

DEFAULT_NUM_SLOTS = 1024
"""Pool slots for kvtool workloads (the shipped ones are small) unless --gpu names a GPU."""
DEFAULT_BYTES_POOL_TOKENS = 524_288
"""KV tokens of the pool of an imported trace replayed in bytes fidelity without --gpu: its pools are
allocated on this machine, so it does not get a GPU's (--gpu asks for one)."""
DEFAULT_REMOTE_GBPS = 25.0
"""Load rate of a shared remote tier (a 200 Gb/s NIC a GPU), for the stacked tiers' remote level."""


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
    gpu_pool: GpuPool | None = None
    """How the GPU pool was derived from the model and the GPU (None: --num-slots or --gpu-memory, or
    a kvtool workload's default)."""
    notes: tuple[str, ...] = ()
    """Lines to say before the replay (a size in SI units, in GiB)."""

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
    gpu: str | None = None
    """`--gpu`: the GPU the cost model and the derived pool assume (None: the H200's cost model,
    and for a kvtool workload the default pool)."""
    tflops: float | None = None
    hbm_gbps: float | None = None
    load_gbps: float | None = None
    remote_gbps: float | None = None
    bandwidth_from: Path | None = None
    """A kvtool bench run folder: its load GB/s at `tokens_per_block` replaces `load_gbps`, and
    turns the cost model on (the rate means nothing without it)."""
    params: float | None = None
    attention_width: int | None = None
    draft_tokens: int = 0
    acceptance: float = 0.7


def build_replay(o: ReplayOptions) -> Replay:
    """The replay the options describe; InputError for anything that cannot run."""
    if o.compat == VLLM_RUNTIME:      # `--compat vllm` names vLLM's own engine, which only `trace run` drives
        raise InputError("this trace command replays through kvtool's engine and does not take a vLLM connector; "
                         "trace run, validate and bench --suite store take --compat vllm (docs/vllm-compat.md)")
    _check_counts(o)
    workload = open_workload(o.workload, o.trace_format, o.source_block_size, o.prefill_only)
    imported = workload.format != "kvtool"
    fidelity = parse_fidelity(o.fidelity) if o.fidelity else (Fidelity.BLOCKS if imported else Fidelity.BYTES)
    model = o.model or ("llama-3.1-8b" if imported else "tiny")
    modelled_tp = o.tp > 1 and o.num_ranks == 1 and fidelity is Fidelity.BLOCKS
    gpu = gpu_named(o.gpu, o.tflops, o.hbm_gbps, o.load_gbps)
    pool = _derived_pool(o, model, gpu, imported and fidelity is Fidelity.BLOCKS)
    num_slots = o.num_slots
    if num_slots is None and o.gpu_memory is None and pool is None:
        num_slots = ceil_div(DEFAULT_BYTES_POOL_TOKENS, o.tokens_per_block) if imported else DEFAULT_NUM_SLOTS
    memory = str(pool.pool_bytes) if pool else o.gpu_memory
    manager = manager_config(model, o.tokens_per_block, None, memory, num_slots,
                             tp=(o.tp, 0) if modelled_tp else (1, 0))
    spec = None if o.connector == "none" else load_connector(o.connector, o.compat)
    options = _connector_options(o, spec)
    rate = None
    if o.bandwidth_from is not None:
        if o.cost_model is False:
            raise InputError("--bandwidth-from sets the cost model's load rate: it cannot go with --no-cost-model")
        rate = bench_rate(o.bandwidth_from, "load", o.tokens_per_block, manager.model.name)
        gpu = replace(gpu, load_gbps=rate.gbps)
        o = replace(o, cost_model=True)
    cost = _cost_model(o, model, gpu, spec, options, imported)
    config = EngineConfig(manager, SchedulerConfig(o.max_batch_size, o.max_num_tokens, o.chunk_size,
                                                   local_reuse=not o.no_local_reuse,
                                                   **_admission(o.admission)),
                          seed=o.seed, runtime=runtime_name(o.runtime), num_ranks=o.num_ranks,
                          tp_size=1 if modelled_tp else o.tp,
                          ranks_as_processes=True, fidelity=fidelity,
                          iteration_time=cost.iteration_seconds if cost else None,
                          draft_tokens=o.draft_tokens, acceptance=o.acceptance)
    return Replay(workload, config, spec, options, cost,
                  rate.describe(o.tokens_per_block, manager.model.name) if rate else None,
                  rate.as_dict() if rate else None, pool, capacity_notes(options))


def _check_counts(o: ReplayOptions) -> None:
    for name, value in (("max-batch-size", o.max_batch_size), ("max-num-tokens", o.max_num_tokens),
                        ("chunk-size", o.chunk_size), ("num-ranks", o.num_ranks), ("tp", o.tp),
                        ("tokens-per-block", o.tokens_per_block)):
        if value is not None and value <= 0:
            raise InputError(f"--{name} must be positive, got {value}")
    if o.draft_tokens < 0:
        raise InputError(f"--draft-tokens must be 0 or more, got {o.draft_tokens}")
    if not 0.0 <= o.acceptance <= 1.0:
        raise InputError(f"--acceptance is a probability: between 0 and 1, got {o.acceptance}")
    if o.remote_gbps is not None and not (o.remote_gbps > 0 and o.remote_gbps != float("inf")):
        raise InputError(f"--remote-gbps must be a positive number, got {o.remote_gbps}")


def _derived_pool(o: ReplayOptions, model: str, gpu: GpuSpec, by_default: bool) -> GpuPool | None:
    """The pool the model leaves on the GPU: with --gpu, or `by_default` (an imported trace in
    blocks fidelity), unless --num-slots or --gpu-memory gives the pool."""
    if o.num_slots is not None or o.gpu_memory is not None or not (by_default or o.gpu is not None):
        return None
    spec = load_model(model)
    try:
        compute = model_compute(spec, o.params, o.attention_width)
    except InputError as exc:
        raise InputError(f"{exc} (or give the GPU pool itself: --gpu-memory)") from None
    return gpu_pool(gpu, compute.weight_bytes, o.tp, spec.name)


def _connector_options(o: ReplayOptions, spec: ConnectorSpec | None) -> dict[str, str]:
    if o.connector_dir is not None and spec is None:
        raise InputError("--connector-dir is the disk connector's folder: give --connector disk")
    options = connector_options(spec, list(o.connector_opt), o.connector_dir) if spec else \
        parse_options(list(o.connector_opt))
    if options and spec is None:
        raise InputError("--connector-opt needs a --connector")
    return options


CAPACITY_OPTIONS = ("capacity", "remote_capacity")
"""Connector options that take a tier size (said in GiB when typed in SI units)."""


def capacity_notes(options: dict[str, str]) -> tuple[str, ...]:
    """`10GB is SI: 10,000,000,000 bytes = 9.31 GiB` for each tier size typed in SI units."""
    notes = []
    for key in CAPACITY_OPTIONS:
        try:
            note = parse_capacity(options[key]).si_note if key in options else None
        except ValueError:
            note = None
        if note:
            notes.append(f"{key}={note}")
    return tuple(notes)


ADMISSIONS: dict[Admission, dict[str, bool]] = {
    Admission.RESERVE: dict(reserve_outputs=True), Admission.GREEDY: dict(),
    Admission.MAX_UTILIZATION: dict(pause_to_grow=True)}
"""Each admission policy -> the SchedulerConfig fields it sets."""


def _admission(admission: str) -> dict[str, bool]:
    """The SchedulerConfig fields of the policy `--admission` named (InputError for another name)."""
    try:
        return ADMISSIONS[Admission(admission)]
    except ValueError:
        raise InputError(f"--admission must be one of {', '.join(ADMISSIONS)}, got {admission!r}") from None


def _cost_model(o: ReplayOptions, model: str, gpu: GpuSpec, spec: ConnectorSpec | None, options: dict[str, str],
                imported: bool) -> CostModel | None:
    """The cost model: on by default for imported traces, off (10 ms an iteration) for kvtool ones."""
    if not (o.cost_model if o.cost_model is not None else imported):
        return None
    whole = KvCacheManagerConfig(load_model(model), o.tokens_per_block, num_slots=1)   # every rank's shard
    per_token = block_bytes(whole) // whole.tokens_per_block
    layerwise = (options.get("mode") or (spec.options.get("mode") if spec else None)) == "layerwise"
    compute = model_compute(whole.model, o.params, o.attention_width)
    return cost_model_for(whole.model, compute, gpu, per_token, o.tp, layerwise,
                          {"host": gpu.load_gbps, "remote": o.remote_gbps or DEFAULT_REMOTE_GBPS})


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
    if replay.config.fidelity != Fidelity.BYTES:
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
    short = [(need - slots, pg, need, slots, size)
             for pg, ((need, size), slots) in enumerate(zip(needs, have, strict=True)) if need > slots]
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
        return all(s >= n for s, n in zip(slots, needs, strict=True))

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
    if replay.config.fidelity != Fidelity.BYTES:
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
