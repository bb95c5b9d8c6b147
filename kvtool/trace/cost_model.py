"""A cost model of one iteration on a GPU, for the replay's clock and the TTFT it reports.

Iteration seconds = prefill and decode compute of the tokens the pass computes + the time to load
the connector's tokens delivered to it (synchronous loads: before the pass; layer-wise: overlapped
with compute layer by layer, so only the part compute cannot hide and the first layer's share
add). Compute FLOPs per token = 2 x active parameters + 4 x layers x attention width x the
context it attends to (the QK^T and AV products, full attention assumed in every layer). An
asynchronous load runs beside the passes and adds nothing to them. Every assumption is a field of
`CostModel`, printed in the report and written into meta.json.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvtool.engine.fake_engine import PassItem
from kvtool.engine.scheduler import Batch
from kvtool.errors import InputError
from kvtool.models import ModelSpec

H200_BF16_TFLOPS = 750.0
"""bf16 matmul rate measured on the H200 (results/h200-compute: 725-780 TFLOP/s alone)."""
H200_LOAD_GBPS = 51.0
"""Host-to-GPU copy rate of the SM kernel on the H200 (shared/DEVICE.md)."""
H200_SAVE_GBPS = 52.5

PRESET_COMPUTE: dict[str, tuple[float, int]] = {
    "tiny": (1.0e6, 64),
    "tiny-vswa": (1.5e6, 64),
    "llama-3.1-8b": (8.03e9, 4096),
    "llama-3.1-70b": (70.6e9, 8192),
    "qwen3-8b": (8.19e9, 4096),
    "mistral-7b": (7.24e9, 4096),
    "gemma-3-27b": (27.4e9, 4096),
    "gpt-oss-20b": (3.6e9, 4096),
    "deepseek-v3": (37.0e9, 24576),
}
"""Preset -> (active parameters, attention width = query heads x head size), from the models'
published configs (mixture-of-experts models count the parameters one token uses)."""


@dataclass(frozen=True)
class CostModel:
    active_params: float
    attention_width: int
    num_layers: int
    kv_bytes_per_token: int
    tflops: float = H200_BF16_TFLOPS
    load_gbps: float = H200_LOAD_GBPS
    layerwise: bool = False
    idle_seconds: float = 0.001
    """Seconds an iteration that computes nothing takes (waiting on a background copy)."""

    def compute_seconds(self, start: int, end: int) -> float:
        """Seconds to compute positions [start, end) of one request."""
        attended = (end * (end + 1) - start * (start + 1)) / 2
        flops = 2 * self.active_params * (end - start) + 4 * self.num_layers * self.attention_width * attended
        return flops / (self.tflops * 1e12)

    def load_seconds(self, num_tokens: int) -> float:
        return num_tokens * self.kv_bytes_per_token / (self.load_gbps * 1e9)

    def iteration_seconds(self, batch: Batch, items: list[PassItem]) -> float:
        compute = sum(self.compute_seconds(i.start, i.end) for i in items if i.request_id >= 0)
        loaded = sum(s.num_external for s in batch.first_chunks)   # asynchronous loads left the batch
        if not items and not loaded:
            return self.idle_seconds
        load = self.load_seconds(loaded)
        if self.layerwise:
            return max(compute, load) + min(compute, load) / max(self.num_layers, 1)
        return compute + load

    def assumptions(self) -> dict:
        return asdict(self)


def cost_model_for(model: ModelSpec, kv_bytes_per_token: int, params: float | None = None,
                   attention_width: int | None = None, tflops: float = H200_BF16_TFLOPS,
                   load_gbps: float = H200_LOAD_GBPS, layerwise: bool = False) -> CostModel:
    """The cost model of `model` (a preset's own figures unless given); InputError when a model
    read from a config file lacks them, or a rate is not positive."""
    known = PRESET_COMPUTE.get(model.name)
    if params is None or attention_width is None:
        if known is None:
            raise InputError(f"no compute figures for model {model.name!r}: give --params and --attention-width")
        params = params if params is not None else known[0]
        attention_width = attention_width if attention_width is not None else known[1]
    width = attention_width
    for name, value in (("--params", params), ("--attention-width", width), ("--tflops", tflops),
                        ("--load-gbps", load_gbps)):
        if not value > 0:
            raise InputError(f"{name} must be positive, got {value}")
    return CostModel(params, width, model.num_layers, kv_bytes_per_token, tflops, load_gbps, layerwise)
