"""Model specs: which layers a model has, their attention window, and the KV buffers per layer.

A spec is built from a named preset (`PRESETS` below, exact numbers) or from a Hugging Face
style `config.json`. Buffer bytes per block = tokens_per_block x num_heads x head_dim x item size.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from kvtool.errors import InputError, did_you_mean
from kvtool.types import LayerId, Role


@dataclass(frozen=True)
class DType:
    name: str
    itemsize: int
    torch_dtype: torch.dtype


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("bf16", 2, torch.bfloat16),
        DType("fp16", 2, torch.float16),
        DType("fp32", 4, torch.float32),
        DType("fp8", 1, torch.float8_e4m3fn),
        DType("int8", 1, torch.int8),
    )
}
_DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
                  "float": "fp32", "float8_e4m3fn": "fp8", "fp8_e4m3": "fp8"}


def dtype_named(name: str) -> DType:
    """The dtype called `name` (`bf16`, `bfloat16`, `fp8`, ...); InputError for anything else."""
    key = _DTYPE_ALIASES.get(name.lower(), name.lower())
    if key not in DTYPES:
        raise InputError(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}")
    return DTYPES[key]


@dataclass(frozen=True)
class BufferSpec:
    """One (layer, role) buffer: per token, `num_heads` heads of `head_dim` elements."""

    role: Role
    num_heads: int
    head_dim: int
    first_head: int = 0
    """Global index of this buffer's first head: a tensor-parallel rank holds heads
    [first_head, first_head + num_heads) of the model's."""
    latent: bool = False
    """An MLA latent: one compressed head, replicated on every tensor-parallel rank."""

    def head_bytes(self, dtype: DType) -> int:
        return self.head_dim * dtype.itemsize

    def bytes_per_token(self, dtype: DType) -> int:
        return self.num_heads * self.head_bytes(dtype)


@dataclass(frozen=True)
class LayerSpec:
    layer_id: LayerId
    window_size: int | None
    """Sliding window in tokens (the current token included); None = full attention."""
    num_sink_tokens: int
    buffers: tuple[BufferSpec, ...]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    dtype: DType
    layers: tuple[LayerSpec, ...]
    origin: str = "preset"
    """Where the spec and its name come from: "preset"; for a config file, "the KEY of PATH" (the
    name is that key's value), or the file's path, which is then the name too."""
    tp_size: int = 1
    tp_rank: int = 0
    """The tensor-parallel shard this spec describes (see `shard_model`)."""

    @property
    def shard_name(self) -> str:
        """The name, with the tensor-parallel shard when there is one: "llama-3.1-8b tp1/2"."""
        return self.name if self.tp_size == 1 else f"{self.name} tp{self.tp_rank}/{self.tp_size}"

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def with_dtype(self, dtype: DType) -> ModelSpec:
        return replace(self, dtype=dtype)

    def buffer_bytes(self, buffer: BufferSpec, tokens_per_block: int) -> int:
        return tokens_per_block * buffer.bytes_per_token(self.dtype)


def heads_across_ranks(model: ModelSpec) -> int:
    """The most heads a buffer of the whole model has (every tensor-parallel rank's, for a shard)."""
    return max(b.num_heads * (1 if b.latent else model.tp_size) for layer in model.layers for b in layer.buffers)


def shard_model(model: ModelSpec, tp_size: int, tp_rank: int) -> ModelSpec:
    """What tensor-parallel rank `tp_rank` of `tp_size` holds: each KV buffer's heads split evenly
    (rank r gets heads [r * h / N, (r + 1) * h / N)), an MLA latent whole on every rank.
    InputError when `tp_size` does not divide a buffer's heads or the rank is out of range."""
    if tp_size < 1:
        raise InputError(f"--tp must be at least 1, got {tp_size}")
    if not 0 <= tp_rank < tp_size:
        raise InputError(f"--rank must be in [0, {tp_size}) for --tp {tp_size}, got {tp_rank}")
    if model.tp_size != 1:
        raise InputError(f"{model.name} is already a tensor-parallel shard")
    return replace(model, layers=tuple(replace(layer, buffers=tuple(_shard(model, b, tp_size, tp_rank)
                                                                    for b in layer.buffers))
                                       for layer in model.layers), tp_size=tp_size, tp_rank=tp_rank)


def _shard(model: ModelSpec, buffer: BufferSpec, tp_size: int, tp_rank: int) -> BufferSpec:
    if buffer.latent or tp_size == 1:
        return buffer
    if buffer.num_heads % tp_size:
        raise InputError(f"--tp {tp_size} does not divide the {buffer.num_heads} KV heads of {model.name}")
    per_rank = buffer.num_heads // tp_size
    return replace(buffer, num_heads=per_rank, first_head=tp_rank * per_rank)


def _kv_buffers(num_kv_heads: int, head_dim: int, mla: bool) -> tuple[BufferSpec, ...]:
    if mla:
        return (BufferSpec(Role.KEY, num_kv_heads, head_dim, latent=True),)
    return (BufferSpec(Role.KEY, num_kv_heads, head_dim), BufferSpec(Role.VALUE, num_kv_heads, head_dim))


def build_model(name: str, num_layers: int, num_kv_heads: int, head_dim: int, dtype: DType,
                window_of: Callable[[int], int | None], mla: bool = False,
                num_sink_tokens: int = 0) -> ModelSpec:
    """A model whose layer `i` has window `window_of(i)` and identical KV heads everywhere."""
    buffers = _kv_buffers(num_kv_heads, head_dim, mla)
    layers = tuple(
        LayerSpec(LayerId(i), window_of(i), num_sink_tokens if window_of(i) else 0, buffers)
        for i in range(num_layers)
    )
    return ModelSpec(name, dtype, layers)


def _full(_: int) -> None:
    return None


def _every_nth_full(n: int, window: int) -> Callable[[int], int | None]:
    return lambda i: None if (i + 1) % n == 0 else window


_BF16 = DTYPES["bf16"]
PRESETS: dict[str, Callable[[], ModelSpec]] = {
    "tiny": lambda: build_model("tiny", 4, 2, 16, _BF16, _full),
    "tiny-vswa": lambda: build_model("tiny-vswa", 6, 2, 16, _BF16, _every_nth_full(3, 8)),
    "llama-3.1-8b": lambda: build_model("llama-3.1-8b", 32, 8, 128, _BF16, _full),
    "llama-3.1-70b": lambda: build_model("llama-3.1-70b", 80, 8, 128, _BF16, _full),
    "qwen3-8b": lambda: build_model("qwen3-8b", 36, 8, 128, _BF16, _full),
    "mistral-7b": lambda: build_model("mistral-7b", 32, 8, 128, _BF16, lambda i: 4096),
    "gemma-3-27b": lambda: build_model("gemma-3-27b", 62, 16, 128, _BF16, _every_nth_full(6, 1024)),
    "gpt-oss-20b": lambda: build_model("gpt-oss-20b", 24, 8, 64, _BF16,
                                       lambda i: 128 if i % 2 == 0 else None),
    "deepseek-v3": lambda: build_model("deepseek-v3", 61, 1, 576, _BF16, _full, mla=True),
}


def load_model(name_or_path: str, dtype: str | None = None) -> ModelSpec:
    """A preset by name, or a Hugging Face style config.json by path; `dtype` overrides the model's."""
    if name_or_path in PRESETS:
        spec = PRESETS[name_or_path]()
    elif Path(name_or_path).suffix == ".json" or Path(name_or_path).exists():
        spec = model_from_hf_config(Path(name_or_path))
    else:
        raise InputError(f"unknown model {name_or_path!r}{_closest_preset(name_or_path)}: not a preset "
                         f"({', '.join(PRESETS)}) and not a config.json path")
    return spec.with_dtype(dtype_named(dtype)) if dtype else spec


def _closest_preset(name: str) -> str:
    """" (did you mean 'PRESET'?)" for a mistyped preset name (`llama3-8b`, `Llama-3.1-8B`: case
    aside, as presets are lower case), or ""."""
    return did_you_mean(name.lower(), PRESETS)


def model_from_hf_config(path: Path) -> ModelSpec:
    """Read a Hugging Face `config.json`; InputError naming the file for anything unusable."""
    try:
        raw = json.loads(path.read_text())
    except OSError as exc:
        raise InputError(f"cannot read model config {path}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"model config {path} is not valid JSON: {exc}") from None
    except RecursionError:
        raise InputError(f"model config {path} is nested too deeply to be a model config") from None
    if not isinstance(raw, dict):
        raise InputError(f"model config {path} must hold a JSON object")
    try:
        spec = _spec_from_hf_dict(raw, default_name=str(path))
    except InputError as exc:
        raise InputError(f"model config {path}: {exc}") from None
    key = next((k for k in ("_name_or_path", "model_type") if raw.get(k)), None)
    return replace(spec, origin=f"the {key} of {path}" if key else str(path))


def _spec_from_hf_dict(raw: dict[str, Any], default_name: str) -> ModelSpec:
    cfg = {**raw, **raw["text_config"]} if isinstance(raw.get("text_config"), dict) else raw
    num_layers = _positive_int(cfg, "num_hidden_layers")
    mla = "kv_lora_rank" in cfg
    if mla:
        num_kv_heads = 1
        head_dim = _positive_int(cfg, "kv_lora_rank") + _positive_int(cfg, "qk_rope_head_dim")
    else:
        num_heads = _positive_int(cfg, "num_attention_heads")
        num_kv_heads = _positive_int(cfg, "num_key_value_heads") if "num_key_value_heads" in cfg else num_heads
        head_dim = (_positive_int(cfg, "head_dim") if cfg.get("head_dim") is not None
                    else _positive_int(cfg, "hidden_size") // num_heads)
        if head_dim == 0:
            raise InputError(f"hidden_size {cfg['hidden_size']} / num_attention_heads {num_heads} is a head size "
                             "of 0; give head_dim")
    dtype_name = cfg.get("torch_dtype") or cfg.get("dtype") or "bf16"
    if not isinstance(dtype_name, str):
        raise InputError(f"torch_dtype must be a string, got {dtype_name!r}")
    windows = _layer_windows(cfg, num_layers)
    name = str(raw.get("_name_or_path") or raw.get("model_type") or default_name)
    return build_model(name, num_layers, num_kv_heads, head_dim, dtype_named(dtype_name),
                       lambda i: windows[i], mla=mla, num_sink_tokens=_sink_tokens(cfg))


def _layer_windows(cfg: dict[str, Any], num_layers: int) -> list[int | None]:
    window = cfg.get("sliding_window")
    if window is None or cfg.get("use_sliding_window") is False:
        return [None] * num_layers
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise InputError(f"sliding_window must be a positive integer, got {window!r}")
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise InputError(f"layer_types must list {num_layers} entries (num_hidden_layers)")
        return [_window_of_type(t, window) for t in layer_types]
    pattern = cfg.get("sliding_window_pattern")
    if pattern is not None:
        if not isinstance(pattern, int) or pattern <= 0:
            raise InputError(f"sliding_window_pattern must be a positive integer, got {pattern!r}")
        return [None if (i + 1) % pattern == 0 else window for i in range(num_layers)]
    return [window] * num_layers


def _window_of_type(layer_type: object, window: int) -> int | None:
    if layer_type in ("sliding_attention", "sliding"):
        return window
    if layer_type in ("full_attention", "full", "attention"):
        return None
    raise InputError(f"unknown layer type {layer_type!r} in layer_types")


def _sink_tokens(cfg: dict[str, Any]) -> int:
    value = cfg.get("num_sink_tokens", 0)
    if not isinstance(value, int) or value < 0:
        raise InputError(f"num_sink_tokens must be a non-negative integer, got {value!r}")
    return value


def _positive_int(cfg: dict[str, Any], key: str) -> int:
    if key not in cfg:
        raise InputError(f"missing key {key!r}")
    value = cfg[key]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InputError(f"{key} must be a positive integer, got {value!r}")
    if value > CONFIG_LIMITS.get(key, 1 << 20):
        raise InputError(f"{key} = {value} is beyond any real model (at most {CONFIG_LIMITS.get(key, 1 << 20)})")
    return value


CONFIG_LIMITS = {"num_hidden_layers": 4096}
"""Upper bounds that keep a mistyped config from building billions of layer specs (others: 2**20)."""
