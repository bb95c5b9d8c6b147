"""What the cost model needs of a model besides its KV layout: parameters a token uses, the bytes
of its weights, its attention and hidden widths. Presets from the models' published configs and
checkpoints; a model read from a config.json gets them from `--params` and `--attention-width`
(its weights then taken as bf16, two bytes a parameter)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvtool.errors import InputError
from kvtool.models import ModelSpec


@dataclass(frozen=True)
class ModelCompute:
    active_params: float
    """Parameters one token multiplies through (mixture-of-experts: the experts it is routed to)."""
    weight_bytes: float
    """Bytes of all the weights (every expert), as served: what the GPUs hold and a decode step reads."""
    attention_width: int
    """Query heads x head size: the width of QK^T and AV."""
    hidden: int
    """Hidden size: the width of a tensor-parallel all-reduce."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


PRESET_COMPUTE: dict[str, ModelCompute] = {
    "tiny": ModelCompute(1.0e6, 2.0e6, 64, 64),
    "tiny-vswa": ModelCompute(1.5e6, 3.0e6, 64, 64),
    "llama-3.1-8b": ModelCompute(8.03e9, 16.06e9, 4096, 4096),
    "llama-3.1-70b": ModelCompute(70.6e9, 141.2e9, 8192, 8192),
    "qwen3-8b": ModelCompute(8.19e9, 16.38e9, 4096, 4096),
    "mistral-7b": ModelCompute(7.24e9, 14.48e9, 4096, 4096),
    "gemma-3-27b": ModelCompute(27.4e9, 54.8e9, 4096, 5376),
    "gpt-oss-20b": ModelCompute(3.6e9, 13.8e9, 4096, 2880),      # MXFP4 experts
    "deepseek-v3": ModelCompute(37.0e9, 671e9, 24576, 7168),     # fp8 weights
}
"""Preset -> its figures (bf16 weights unless said)."""


def model_compute(model: ModelSpec, params: float | None = None,
                  attention_width: int | None = None) -> ModelCompute:
    """`model`'s figures, `params` and `attention_width` replacing a preset's (a model from a
    config file needs both); InputError when missing or not positive."""
    known = PRESET_COMPUTE.get(model.name)
    if known is None and (params is None or attention_width is None):
        raise InputError(f"no compute figures for model {model.name!r}: give --params and --attention-width")
    for name, value in (("--params", params), ("--attention-width", attention_width)):
        if value is not None and not (value > 0 and value != float("inf")):
            raise InputError(f"{name} must be positive, got {value}")
    if known is None:
        assert params is not None and attention_width is not None
        return ModelCompute(params, 2.0 * params, attention_width, attention_width)
    active = params if params is not None else known.active_params
    width = attention_width if attention_width is not None else known.attention_width
    weights = known.weight_bytes * active / known.active_params
    return ModelCompute(active, weights, width, known.hidden)
