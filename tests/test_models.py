import json

import pytest

from kvtool.errors import InputError
from kvtool.models import PRESETS, load_model
from kvtool.types import Role

DATA = "tests/data/hf_configs"


@pytest.mark.parametrize("name, layers, heads, dim, windows", [
    ("tiny", 4, 2, 16, [None] * 4),
    ("tiny-vswa", 6, 2, 16, [8, 8, None, 8, 8, None]),
    ("llama-3.1-8b", 32, 8, 128, [None] * 32),
    ("llama-3.1-70b", 80, 8, 128, [None] * 80),
    ("qwen3-8b", 36, 8, 128, [None] * 36),
    ("mistral-7b", 32, 8, 128, [4096] * 32),
    ("gemma-3-27b", 62, 16, 128, [None if (i + 1) % 6 == 0 else 1024 for i in range(62)]),
    ("gpt-oss-20b", 24, 8, 64, [128 if i % 2 == 0 else None for i in range(24)]),
    ("deepseek-v3", 61, 1, 576, [None] * 61),
])
def test_presets_have_the_design_numbers(name, layers, heads, dim, windows):
    spec = load_model(name)
    assert spec.num_layers == layers and spec.dtype.name == "bf16"
    assert [layer.window_size for layer in spec.layers] == windows
    for layer in spec.layers:
        roles = [b.role for b in layer.buffers]
        assert roles == ([Role.KEY] if name == "deepseek-v3" else [Role.KEY, Role.VALUE])
        assert {(b.num_heads, b.head_dim) for b in layer.buffers} == {(heads, dim)}


def test_every_preset_is_covered():
    assert len(PRESETS) == 9


def test_dtype_override_changes_item_size():
    assert load_model("tiny", "fp8").dtype.itemsize == 1
    assert load_model("tiny", "float32").dtype.name == "fp32"
    with pytest.raises(InputError, match="unknown dtype"):
        load_model("tiny", "int3")


def test_hf_llama_config_matches_the_preset_shape():
    spec = load_model(f"{DATA}/llama-like/config.json")
    assert spec.name == "llama-like-8b" and spec.num_layers == 32
    assert {(b.num_heads, b.head_dim) for layer in spec.layers for b in layer.buffers} == {(8, 128)}


def test_hf_gemma3_uses_text_config_and_the_window_pattern():
    spec = load_model(f"{DATA}/gemma3-like/config.json")
    assert [layer.window_size for layer in spec.layers] == \
        [layer.window_size for layer in load_model("gemma-3-27b").layers]


def test_hf_layer_types_and_mla():
    oss = load_model(f"{DATA}/gpt-oss-like/config.json")
    assert [layer.window_size for layer in oss.layers] == [128 if i % 2 == 0 else None for i in range(24)]
    mla = load_model(f"{DATA}/deepseek-like/config.json")
    assert [(b.role, b.num_heads, b.head_dim) for b in mla.layers[0].buffers] == [(Role.KEY, 1, 576)]


def test_hf_head_dim_falls_back_to_hidden_over_heads(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256,
                                "torch_dtype": "float16", "sliding_window": 64, "use_sliding_window": False}))
    spec = load_model(str(path))
    assert spec.layers[0].buffers[0].head_dim == 64 and spec.dtype.name == "fp16"
    assert spec.layers[0].buffers[0].num_heads == 4  # no num_key_value_heads: one KV head per head
    assert [layer.window_size for layer in spec.layers] == [None, None]


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ('{"num_attention_heads": 4, "hidden_size": 64}', "missing key 'num_hidden_layers'"),
    ('{"num_hidden_layers": -1, "num_attention_heads": 4, "hidden_size": 64}', "positive integer"),
    ('{"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, "torch_dtype": "int3"}', "unknown dtype"),
    ('{"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, "sliding_window": 8,'
     ' "layer_types": ["sliding_attention"]}', "layer_types must list 2"),
])
def test_malformed_configs_give_one_clear_error(tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(InputError, match=message) as info:
        load_model(str(path))
    assert str(path) in str(info.value)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(InputError, match="llama-3.1-8b"):
        load_model("llama-9")
