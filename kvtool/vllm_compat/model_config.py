"""A kvtool model as vLLM sees it: a local `config.json` (no hub, no weights) and one KV cache spec
per attention layer, named as vLLM's Llama names its attention layers.

vLLM's scheduler never reads a weight: `ModelConfig` over the config file gives it the model's
length limit and dtype; the KV cache specs (`FullAttentionSpec`, `SlidingWindowSpec`) are what each
attention layer's `get_kv_cache_spec()` would return, and decide the KV cache groups.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtool.errors import InputError
from kvtool.models import LayerSpec, ModelSpec

VOCAB_SIZE = 32000
"""The config's vocabulary: the fake forward samples tokens below it."""

_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def layer_name(layer_id: int) -> str:
    """vLLM's name of a decoder layer's attention module (the key of `register_kv_caches`)."""
    return f"model.layers.{layer_id}.self_attn.attn"


@dataclass(frozen=True)
class VllmModel:
    """A kvtool model checked for what the driver supports, with vLLM's names for it."""

    spec: ModelSpec

    @classmethod
    def of(cls, spec: ModelSpec) -> VllmModel:
        """InputError for what the driver does not play: MLA latents, attention sinks, a dtype
        without a vLLM name, layers whose key and value differ in heads or width."""
        if spec.dtype.name not in _DTYPE_NAMES:
            raise InputError(f"--compat vllm: {spec.name}'s dtype {spec.dtype.name} is not driven; "
                             f"use one of {', '.join(_DTYPE_NAMES)}")
        for layer in spec.layers:
            _check_layer(spec.name, layer)
        return cls(spec)

    @property
    def dtype_name(self) -> str:
        return _DTYPE_NAMES[self.spec.dtype.name]

    @property
    def num_kv_heads(self) -> int:
        return self.spec.layers[0].buffers[0].num_heads

    @property
    def head_dim(self) -> int:
        return self.spec.layers[0].buffers[0].head_dim

    @property
    def layer_names(self) -> list[str]:
        return [layer_name(layer.layer_id) for layer in self.spec.layers]

    @property
    def is_hybrid(self) -> bool:
        """Layers of more than one attention window: vLLM's hybrid allocator (several groups)."""
        return len({layer.window_size for layer in self.spec.layers}) > 1

    def windows(self) -> dict[str, int | None]:
        """Each layer's sliding window in tokens (None: full attention), by vLLM layer name."""
        return {layer_name(layer.layer_id): layer.window_size for layer in self.spec.layers}

    def write_config(self, folder: Path) -> Path:
        """A Hugging Face `config.json` of this model in `folder` (created); the folder's path."""
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(self._hf_config(), indent=2) + "\n")
        return folder

    def _hf_config(self) -> dict[str, Any]:
        heads = self.num_kv_heads
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "hidden_size": heads * self.head_dim, "intermediate_size": 2 * heads * self.head_dim,
                "num_hidden_layers": self.spec.num_layers, "num_attention_heads": heads,
                "num_key_value_heads": heads, "head_dim": self.head_dim, "vocab_size": VOCAB_SIZE,
                "max_position_embeddings": 1 << 16, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                "torch_dtype": self.dtype_name, "bos_token_id": 1, "eos_token_id": 2,
                "tie_word_embeddings": False}


def _check_layer(model: str, layer: LayerSpec) -> None:
    if any(b.latent for b in layer.buffers):
        raise InputError(f"--compat vllm: {model} is an MLA model; the driver plays full and sliding-window "
                         "attention only")
    if layer.num_sink_tokens:
        raise InputError(f"--compat vllm: {model} has attention sinks; the driver does not play them")
    shapes = {(b.num_heads, b.head_dim, b.first_head) for b in layer.buffers}
    if len(layer.buffers) != 2 or len(shapes) != 1:
        raise InputError(f"--compat vllm: {model}'s layer {layer.layer_id} needs a key and a value of one shape")
