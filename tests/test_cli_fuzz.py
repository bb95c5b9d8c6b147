"""Fuzzing the command line: whatever the values, the answer is exit 0, or exit 2 with one line."""

from __future__ import annotations

import json
import time
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvtool.cli import app

runner = CliRunner()
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

numbers = st.one_of(st.integers(-3, 3), st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
                    st.booleans(), st.none(), st.text(max_size=4), st.lists(st.integers(0, 3), max_size=2))
config_keys = ["num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size", "head_dim",
               "sliding_window", "sliding_window_pattern", "layer_types", "torch_dtype", "kv_lora_rank",
               "qk_rope_head_dim", "text_config", "model_type"]


def assert_clean(result) -> None:
    assert "Traceback" not in result.output, result.output
    assert result.exit_code in (0, 2), (result.exit_code, result.output[-2000:])
    if result.exit_code == 2:
        lines = result.stderr.strip().splitlines()
        assert len(lines) >= 1 and lines[-1].startswith("kvtool: error: "), result.stderr


@FUZZ
@given(tpb=st.one_of(st.integers(-5, 2**45), st.sampled_from(["x", "1e3", ""])),
       memory=st.one_of(st.none(), st.sampled_from(["", "0", "1", "8GiB", "1000TiB", "nan", "-1GiB", "1e400"])),
       slots=st.one_of(st.none(), st.integers(-2, 2**40)))
def test_inspect_layout_sizes(tpb, memory, slots):
    args = ["inspect-layout", "--model", "tiny", "--tokens-per-block", str(tpb), "--format", "json"]
    args += [] if memory is None else ["--gpu-memory", memory]
    args += [] if slots is None else ["--num-slots", str(slots)]
    assert_clean(runner.invoke(app, args))


@FUZZ
@given(config=st.dictionaries(st.sampled_from(config_keys), numbers, max_size=8))
@example(config={"num_hidden_layers": 32, "num_attention_heads": 64, "hidden_size": 32})   # head size 0
def test_model_configs(tmp_path_factory, config):
    base = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_text(json.dumps({**base, **config}))
    assert_clean(runner.invoke(app, ["inspect-layout", "--model", str(path), "--format", "json", "--num-slots", "4"]))


def test_a_deeply_nested_config_is_an_input_error(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    assert_clean(runner.invoke(app, ["inspect-layout", "--model", str(path)]))


def test_a_head_size_of_zero_is_an_input_error(tmp_path):
    """hidden_size / num_attention_heads below 1 (and no head_dim): one line, not a ZeroDivisionError."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_hidden_layers": 32, "num_attention_heads": 64, "hidden_size": 32}))
    result = runner.invoke(app, ["inspect-layout", "--model", str(path)])
    assert_clean(result)
    assert result.exit_code == 2 and "head size of 0; give head_dim" in result.stderr


def test_a_billion_layers_is_refused_quickly(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_hidden_layers": 10**9, "num_attention_heads": 8, "hidden_size": 1024}))
    started = time.perf_counter()
    result = runner.invoke(app, ["inspect-layout", "--model", str(path), "--num-slots", "4"])
    assert_clean(result)
    assert result.exit_code == 2 and "num_hidden_layers = 1000000000 is beyond any real model" in result.stderr
    # refused from the config alone: building a billion layers' layout would take minutes and gigabytes
    assert time.perf_counter() - started < 10


def test_a_deeply_nested_workload_line_is_an_input_error(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    result = runner.invoke(app, ["trace", "run", str(path)])
    assert_clean(result)
    assert result.exit_code == 2 and "nested too deeply" in result.stderr


def test_sizes_beyond_the_machine_are_refused_before_allocating(tmp_path, monkeypatch):
    """...and leave no run folder behind (bench's default one is created before the sizes are read)."""
    workload = Path("workloads/shared_prefix.jsonl").resolve()
    monkeypatch.chdir(tmp_path)
    memory = "more than this machine's memory"
    for args, message in ((["trace", "run", str(workload), "--gpu-memory", "1000TiB"], memory),
                          (["trace", "run", str(workload), "--tokens-per-block", str(2**40)],
                           "tokens per block must be at most 32767"),   # the manager's limit comes first
                          (["bench", "--quick", "--batch-bytes", "1000TiB"], memory),
                          (["bench", "--quick", "--tokens-per-block", str(2**40)],
                           "tokens per block must be at most 32767")):
        result = runner.invoke(app, args)
        assert_clean(result)
        assert result.exit_code == 2 and message in result.stderr, args
        assert not (tmp_path / "results").exists(), args


def test_a_failed_run_removes_only_the_empty_folders_it_created(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "mine"
    mine.mkdir()
    result = runner.invoke(app, ["bench", "--quick", "--batch-bytes", "1000TiB", "--output", str(mine)])
    assert result.exit_code == 2 and mine.is_dir()                       # the user's folder stays
    deep = runner.invoke(app, ["bench", "--quick", "--batch-bytes", "1000TiB", "--output", str(mine / "a" / "b")])
    assert deep.exit_code == 2 and list(mine.iterdir()) == []            # its new parents go too
    done = runner.invoke(app, ["bench", "--suite", "manager", "--output", str(tmp_path / "ok")])
    assert done.exit_code == 0 and (tmp_path / "ok" / "meta.json").exists()
    again = runner.invoke(app, ["bench", "--quick", "--batch-bytes", "1000TiB", "--output", str(tmp_path / "ok")])
    assert again.exit_code == 2 and (tmp_path / "ok" / "meta.json").exists()   # an earlier run's results stay


def test_a_request_larger_than_the_whole_cache_is_refused_at_once(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"request_id": 7, "prompt": [1, 2, 3, 4], "max_new_tokens": 1000000}\n')
    result = runner.invoke(app, ["trace", "run", str(path), "--num-slots", "64"])
    assert_clean(result)
    assert result.exit_code == 2 and "request 7 (4 prompt + 1000000 new tokens) needs" in result.stderr
