"""Workload formats: detection, Mooncake/Bailian records, token synthesis, errors with file and line."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.errors import InputError
from kvtool.workloads.source import detect_format, open_workload
from kvtool.workloads.synthesis import synthesize_tokens

runner = CliRunner()


def write_lines(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


MOONCAKE = [{"timestamp": 0, "input_length": 1000, "output_length": 3, "hash_ids": [7, 8]},
            {"timestamp": 250, "input_length": 600, "output_length": 0, "hash_ids": [7, 9]}]
BAILIAN = [{"chat_id": 1, "parent_chat_id": -1, "timestamp": 0.5, "input_length": 20, "output_length": 4,
            "type": "text", "turn": 1, "hash_ids": [3, 4]}]


def test_mooncake_records_become_requests_with_synthesized_prompts(tmp_path):
    workload = open_workload(write_lines(tmp_path / "m.jsonl", MOONCAKE))
    first, second = workload.requests()
    assert workload.format == "mooncake" and workload.count() == 2
    assert (first.request_id, first.prompt_len, first.max_new_tokens, first.arrival) == (0, 1000, 3, 0.0)
    assert (second.request_id, second.prompt_len, second.arrival) == (1, 600, 0.25)
    # block 7 is shared, so the first 512 tokens are equal, and block 8 and 9 differ from token 512 on
    assert first.prompt_token_ids[:512] == second.prompt_token_ids[:512]
    assert first.prompt_token_ids[512] != second.prompt_token_ids[512]


def test_bailian_is_detected_and_counts_seconds_and_16_token_blocks(tmp_path):
    (request,) = open_workload(write_lines(tmp_path / "b.jsonl", BAILIAN)).requests()
    assert detect_format(tmp_path / "b.jsonl") == "bailian"
    assert (request.prompt_len, request.max_new_tokens, request.arrival) == (20, 4, 0.5)
    assert list(request.prompt_token_ids[:16]) == synthesize_tokens([3], 16, 16).tolist()


def test_a_blocks_tokens_are_a_pure_function_of_its_id():
    one = synthesize_tokens([5, 6, 7], 1500, 512)
    assert one.dtype == np.uint32 and len(one) == 1500
    assert (synthesize_tokens([9, 6], 1024, 512)[512:] == one[512:1024]).all()   # id 6 anywhere: same tokens
    assert (synthesize_tokens([7], 476, 512) == one[1024:]).all()                  # a partial block is a prefix
    assert len(set(one.tolist())) > 1490                                           # and the tokens look random


def test_a_source_block_size_override_changes_the_tokens_per_id(tmp_path):
    path = write_lines(tmp_path / "m.jsonl", [{"timestamp": 0, "input_length": 100, "output_length": 0,
                                              "hash_ids": [1, 2, 3, 4]}])
    (request,) = open_workload(path, block_size=32).requests()
    assert request.prompt_len == 100
    with pytest.raises(InputError, match="line 1: 4 hash_ids for input_length 100"):
        list(open_workload(path).requests())


def test_prefill_only_drops_every_output(tmp_path):
    requests = list(open_workload(write_lines(tmp_path / "m.jsonl", MOONCAKE), prefill_only=True).requests())
    assert [r.max_new_tokens for r in requests] == [0, 0]


def test_requests_are_streamed_not_read_at_once(tmp_path):
    path = write_lines(tmp_path / "m.jsonl", MOONCAKE + ["{broken"])
    stream = open_workload(path).requests()
    assert next(stream).request_id == 0 and next(stream).request_id == 1   # read before the bad line is reached
    with pytest.raises(InputError, match="line 3: not valid JSON"):
        next(stream)


GOOD = json.dumps(MOONCAKE[0])


@pytest.mark.parametrize("line, message", [
    ('{"timestamp": 1, "input_length": -5, "output_length": 1, "hash_ids": []}',
     "input_length must be an integer >= 1"),
    ('{"timestamp": 1, "input_length": 5, "output_length": -1, "hash_ids": [1]}', "output_length must be"),
    ('{"timestamp": 1, "input_length": 1025, "output_length": 1, "hash_ids": [1, 2]}',
     "2 hash_ids for input_length 1025"),
    ('{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [-1]}',
     "hash_ids must be a list of integers"),
    ('{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [1]}', "timestamp must be a finite"),
    ('{"timestamp": 1, "input_length": 5, "output_length": 1}', "missing field 'hash_ids'"),
    ('{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [1], "x": 1}', "unknown field(s) x"),
    ('not json', "not valid JSON"),
])
def test_malformed_trace_lines_exit_2_naming_file_and_line(tmp_path, line, message):
    path = write_lines(tmp_path / "bad.jsonl", [GOOD, line])
    result = runner.invoke(app, ["trace", "run", str(path)])
    assert result.exit_code == 2, result.output
    assert f"bad.jsonl line 2: {message}" in result.stderr and "Traceback" not in result.output


def test_an_unknown_first_line_asks_for_the_format(tmp_path):
    path = write_lines(tmp_path / "x.jsonl", [{"foo": 1}])
    result = runner.invoke(app, ["trace", "run", str(path)])
    assert result.exit_code == 2 and "x.jsonl line 1: cannot tell the workload format" in result.stderr
    result = runner.invoke(app, ["trace", "run", str(path), "--trace-format", "nope"])
    assert result.exit_code == 2 and "unknown workload format 'nope'" in result.stderr


def test_arrivals_out_of_order_are_an_input_error(tmp_path):
    path = write_lines(tmp_path / "m.jsonl", list(reversed(MOONCAKE)))
    result = runner.invoke(app, ["trace", "run", str(path)])
    assert result.exit_code == 2 and "request 1 arrives at 0 s, before" in result.stderr
