import io
import json

import pandas as pd
import pytest
from typer.testing import CliRunner

from kvtool.cli import app

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, ["inspect-layout", *args])


def layout_json(*args):
    result = invoke("--format", "json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_json_for_llama_pins_the_region():
    doc = layout_json()
    assert (doc["model"], doc["tokens_per_block"], doc["dtype"]) == ("llama-3.1-8b", 32, "bf16")
    (group,) = doc["layer_groups"]
    assert group["layer_ids"] == list(range(32)) and group["window_size"] is None
    (region,) = group["regions"]
    assert region["size"] == region["stride"] == 4194304
    assert region["buffers"][:3] == [{"layer_id": 0, "role": "key", "heads": [0, 8]},
                                     {"layer_id": 0, "role": "value", "heads": [0, 8]},
                                     {"layer_id": 1, "role": "key", "heads": [0, 8]}]
    assert len(region["buffers"]) == 64
    (pool_group,) = doc["pool_groups"]
    assert set(pool_group) >= {"pool_group_index", "num_slots", "layer_group_ids", "pools"}
    assert pool_group["pools"] == [{"pool_index": 0, "base": 0, "slot_bytes": 4194304}]


def test_json_for_gemma_and_gpt_oss():
    gemma = layout_json("--model", "gemma-3-27b")
    assert [g["window_size"] for g in gemma["layer_groups"]] == [1024, None]
    assert [[p["slot_bytes"] for p in pg["pools"]] for pg in gemma["pool_groups"]] == [[13631488], [2621440]]
    oss = layout_json("--model", "gpt-oss-20b")
    assert len(oss["layer_groups"]) == 2 and len(oss["pool_groups"]) == 1
    assert oss["pool_groups"][0]["layer_group_ids"] == [0, 1]
    assert oss["pool_groups"][0]["pools"][0]["slot_bytes"] == 786432


def test_json_for_deepseek_at_64_tokens():
    doc = layout_json("--model", "deepseek-v3", "--tokens-per-block", "64", "--num-slots", "10")
    region = doc["layer_groups"][0]["regions"][0]
    assert region["size"] == 4497408 and region["num_slots"] == 10
    assert {b["role"] for b in region["buffers"]} == {"key"} and len(region["buffers"]) == 61


def test_dtype_option_halves_the_slot():
    doc = layout_json("--dtype", "fp8", "--num-slots", "4")
    assert doc["dtype"] == "fp8" and doc["layer_groups"][0]["bytes_per_page"] == 2097152


def test_csv_is_one_row_per_region():
    result = invoke("--format", "csv", "--model", "gemma-3-27b")
    assert result.exit_code == 0
    frame = pd.read_csv(io.StringIO(result.stdout))
    assert list(frame["layer_group_id"]) == [0, 1] and list(frame["size"]) == [13631488, 2621440]
    assert pd.isna(frame["window_size"][1]) and frame["window_size"][0] == 1024


def test_table_shows_groups_pools_and_totals():
    result = invoke("--model", "gpt-oss-20b")
    assert result.exit_code == 0
    text = result.stdout
    assert "0,2,4,…,22" in text and "1,3,5,…,23" in text and "pool groups" in text and "totals" in text
    assert "786432" in text


def test_output_file(tmp_path):
    target = tmp_path / "out" / "layout.json"
    assert invoke("--format", "json", "--output", str(target)).exit_code == 0
    assert json.loads(target.read_text())["model"] == "llama-3.1-8b"


def test_hf_config_path(tmp_path):
    doc = layout_json("--model", "tests/data/hf_configs/gpt-oss-like/config.json", "--num-slots", "3")
    assert [g["window_size"] for g in doc["layer_groups"]] == [128, None]


@pytest.mark.parametrize("args, message", [
    (["--model", "llama-9"], "unknown model"),
    (["--model", "missing/config.json"], "cannot read model config"),
    (["--tokens-per-block", "0"], "tokens per block must be positive"),
    (["--tokens-per-block", "-3"], "tokens per block must be positive"),
    (["--gpu-memory", "1MiB"], "cannot hold one slot"),
    (["--gpu-memory", "lots"], "cannot read size"),
    (["--gpu-memory", "1GiB", "--num-slots", "3"], "not both"),
    (["--num-slots", "0"], "num_slots must be positive"),
    (["--dtype", "int3"], "unknown dtype"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    result = invoke(*args)
    assert result.exit_code == 2
    assert message in result.stderr
    assert "Traceback" not in result.output and len(result.stderr.strip().splitlines()) == 1


def test_malformed_config_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"num_hidden_layers": "many"}')
    result = invoke("--model", str(path))
    assert result.exit_code == 2 and "num_hidden_layers must be a positive integer" in result.stderr
