"""What `trace run` and `trace sweep` share: reading the workload options into a `Replay` (the
workload, the engine config, the connector) with every check done before any work."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from kvtool.blocks import ceil_div
from kvtool.cli.common import connector_options, manager_config, parse_options
from kvtool.connector.loader import ConnectorSpec
from kvtool.connectors.registry import load_connector
from kvtool.engine.cost_model import H200_BF16_TFLOPS, H200_LOAD_GBPS, CostModel, cost_model_for
from kvtool.engine.engine import EngineConfig
from kvtool.engine.scheduler import SchedulerConfig
from kvtool.errors import InputError
from kvtool.manager.manager import compute_layout
from kvtool.report.bench_report import bench_gbps
from kvtool.workloads.source import Workload, open_workload

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
    seed: int = 0
    num_ranks: int = 1
    tp: int = 1
    cost_model: bool | None = None
    tflops: float = H200_BF16_TFLOPS
    load_gbps: float = H200_LOAD_GBPS
    bandwidth_from: Path | None = None
    """A kvtool bench run folder: its load GB/s at `tokens_per_block` replaces `load_gbps`."""
    params: float | None = None
    attention_width: int | None = None


def build_replay(o: ReplayOptions) -> Replay:
    """The replay the options describe; InputError for anything that cannot run."""
    for name, value in (("max-batch-size", o.max_batch_size), ("max-num-tokens", o.max_num_tokens),
                        ("chunk-size", o.chunk_size), ("num-ranks", o.num_ranks), ("tp", o.tp),
                        ("tokens-per-block", o.tokens_per_block)):
        if value is not None and value <= 0:
            raise InputError(f"--{name} must be positive, got {value}")
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
    if o.bandwidth_from is not None:
        o = replace(o, load_gbps=bench_gbps(o.bandwidth_from, "load", o.tokens_per_block, manager.model.name))
    cost = _cost_model(o, manager, spec, options, imported)
    config = EngineConfig(manager, SchedulerConfig(o.max_batch_size, o.max_num_tokens, o.chunk_size,
                                                   local_reuse=not o.no_local_reuse,
                                                   reserve_outputs=_reserve_outputs(o.admission)),
                          seed=o.seed, num_ranks=o.num_ranks, tp_size=o.tp, ranks_as_processes=True,
                          fidelity=fidelity, iteration_time=cost.iteration_seconds if cost else None)
    return Replay(workload, config, spec, options, cost)


ADMISSIONS = ("reserve", "greedy")


def _reserve_outputs(admission: str) -> bool:
    if admission not in ADMISSIONS:
        raise InputError(f"--admission must be one of {', '.join(ADMISSIONS)}, got {admission!r}")
    return admission == "reserve"


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
