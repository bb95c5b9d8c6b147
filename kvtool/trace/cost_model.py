"""A cost model of one iteration on a GPU, for the replay's clock and the TTFT it reports.

One iteration runs every request of the batch in one pass, each rank of a tensor-parallel group
holding 1/tp of the weights, of the KV heads and of the work:

    pass = max(FLOPs / (tp x TFLOP/s), (weights / tp + KV read / tp) / HBM GB/s) + all-reduces
    iteration = pass + loads            (layer-wise connectors: max(pass, loads) + the smaller / layers)

- FLOPs per token = 2 x active parameters + 4 x layers x attention width x the context it attends
  to (QK^T and AV; full attention assumed in every layer). A prefill chunk is compute-bound.
- A decode step reads every weight and its whole context's KV once: memory-bound, so a batch of
  decode steps costs about what one does (the weights are read once for all): batching.
- All-reduces (tp > 1): two a layer, each the latency plus its bytes (tokens x hidden x 2 B, a
  ring's 2 (tp - 1) / tp of them) at the NVLink rate.
- Loads: the connector tokens delivered to the pass's first chunks, each rank its shard, at the
  tier's rate (`tier_gbps` for a connector that says which tier served what, else `load_gbps`); an
  asynchronous load runs beside the passes and adds nothing.

Every assumption is a field here (or of the `GpuSpec` and `ModelCompute` it holds), printed in the
report and written into meta.json (`assumptions`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from kvtool.engine.pass_types import PassItem
from kvtool.engine.request_state import RequestState
from kvtool.engine.scheduler import Batch
from kvtool.errors import InputError
from kvtool.models import ModelSpec
from kvtool.trace.gpus import GpuSpec
from kvtool.trace.model_compute import ModelCompute

BF16_BYTES = 2


@runtime_checkable
class TierSplit(Protocol):
    """A connector scheduler that says which tier served a delivery (the stacked tiers do)."""

    def kvtool_tier_tokens(self, request_id: int) -> Mapping[str, int]:
        """Tokens of the request's latest delivery, per tier name."""


class SplitSource:
    """Where the cost model reads tier splits: the connector of the replay running now (`bind`)."""

    def __init__(self) -> None:
        self.connector: TierSplit | None = None

    def bind(self, scheduler: object | None) -> None:
        """Read splits from `scheduler` from now on (None, or one that does not say: no split)."""
        self.connector = scheduler if isinstance(scheduler, TierSplit) else None


@dataclass(frozen=True)
class CostModel:
    model: ModelCompute
    gpu: GpuSpec
    num_layers: int
    kv_bytes_per_token: int
    """KV bytes of one token over the whole model (every rank's shard)."""
    tp: int = 1
    layerwise: bool = False
    tier_gbps: tuple[tuple[str, float], ...] = ()
    """Load rate per tier name, for a connector that splits its deliveries (`TierSplit`)."""
    idle_seconds: float = 0.001
    """Seconds an iteration that computes nothing takes (waiting on a background copy)."""
    split: SplitSource = field(default_factory=SplitSource, compare=False, repr=False)

    @property
    def load_gbps(self) -> float:
        return self.gpu.load_gbps

    def compute_seconds(self, start: int, end: int) -> float:
        """Seconds of compute to run positions [start, end) of one request (its FLOPs alone)."""
        return self._flops(start, end) / (self.tp * self.gpu.tflops * 1e12)

    def _flops(self, start: int, end: int) -> float:
        attended = (end * (end + 1) - start * (start + 1)) / 2
        return (2 * self.model.active_params * (end - start)
                + 4 * self.num_layers * self.model.attention_width * attended)

    def pass_seconds(self, spans: Iterable[tuple[int, int]]) -> float:
        """Seconds of one pass computing each [start, end) of `spans` (a request each)."""
        spans = list(spans)
        flops = sum(self._flops(s, e) for s, e in spans)
        kv_read = sum(e for _, e in spans) * self.kv_bytes_per_token
        compute = flops / (self.tp * self.gpu.tflops * 1e12)
        memory = (self.model.weight_bytes + kv_read) / (self.tp * self.gpu.hbm_gbps * 1e9)
        return max(compute, memory) + self.allreduce_seconds(sum(e - s for s, e in spans))

    def allreduce_seconds(self, num_tokens: int) -> float:
        """Two all-reduces a layer of `num_tokens` hidden states (none without tensor parallelism)."""
        if self.tp == 1:
            return 0.0
        ring_bytes = 2 * (self.tp - 1) / self.tp * num_tokens * self.model.hidden * BF16_BYTES
        return 2 * self.num_layers * (self.gpu.allreduce_us * 1e-6 + ring_bytes / (self.gpu.nvlink_gbps * 1e9))

    def load_seconds(self, num_tokens: int, gbps: float | None = None) -> float:
        """Seconds to load `num_tokens` tokens' KV, each rank its shard, at `gbps` (default the GPU's)."""
        return num_tokens * self.kv_bytes_per_token / self.tp / ((gbps or self.gpu.load_gbps) * 1e9)

    def _loads(self, started: list[RequestState]) -> float:
        rates = dict(self.tier_gbps)
        total = 0.0
        for state in started:
            if not state.num_external:
                continue
            split = self.split.connector.kvtool_tier_tokens(state.request_id) if self.split.connector else {}
            if sum(split.values()) != state.num_external:
                split = {"": state.num_external}
            total += sum(self.load_seconds(n, rates.get(tier)) for tier, n in split.items())
        return total

    def iteration_seconds(self, batch: Batch, items: list[PassItem]) -> float:
        spans = [(i.start, i.end) for i in items if i.request_id >= 0]
        load = self._loads(batch.first_chunks)      # asynchronous loads left the batch
        if not spans and not load:
            return self.idle_seconds
        compute = self.pass_seconds(spans) if spans else 0.0
        if self.layerwise:
            return max(compute, load) + min(compute, load) / max(self.num_layers, 1)
        return compute + load

    def assumptions(self) -> dict[str, Any]:
        """Every figure the model uses, flat (meta.json's `cost_model`)."""
        return {**self.model.as_dict(), "num_layers": self.num_layers, "kv_bytes_per_token": self.kv_bytes_per_token,
                **{("gpu" if k == "name" else k): v for k, v in self.gpu.as_dict().items()
                   if k != "memory_bytes"},
                "tp": self.tp, "layerwise": self.layerwise, "tier_gbps": dict(self.tier_gbps),
                "idle_seconds": self.idle_seconds}


def cost_model_for(model: ModelSpec, compute: ModelCompute, gpu: GpuSpec, kv_bytes_per_token: int, tp: int = 1,
                   layerwise: bool = False, tier_gbps: Mapping[str, float] | None = None) -> CostModel:
    """The cost model of `model` on `tp` GPUs of `gpu`; InputError for a tier rate that is not positive."""
    for tier, gbps in (tier_gbps or {}).items():
        if not gbps > 0:
            raise InputError(f"--{tier}-gbps must be positive, got {gbps}")
    return CostModel(compute, gpu, model.num_layers, kv_bytes_per_token, tp, layerwise,
                     tuple(sorted((tier_gbps or {}).items())))
