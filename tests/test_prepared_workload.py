"""A workload prepared once (`prepare_workload`) streams the same requests as its source, and a
sweep's points read it instead of parsing the trace again."""

import importlib
from pathlib import Path

from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.workloads.prepared import prepare_workload
from kvtool.workloads.source import open_workload

ROOT = Path(__file__).resolve().parents[1]
trace_sweep = importlib.import_module("kvtool.cli.trace_sweep")   # kvtool.cli.trace_sweep is also a command


def _described(requests):
    return [(r.request_id, list(r.prompt_token_ids), r.max_new_tokens, r.cache_salt, r.is_generation_only_request,
             r.arrival) for r in requests]


def test_a_prepared_trace_streams_the_requests_of_its_source(tmp_path):
    source = open_workload(ROOT / "workloads" / "mooncake_conversation_head200.jsonl", prefill_only=True)
    prepared = prepare_workload(source, tmp_path)
    assert _described(prepared.requests()) == _described(source.requests())
    assert list(prepared.request_sizes()) == list(source.request_sizes())


def test_a_prepared_kvtool_workload_keeps_salts_and_output_lengths(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"request_id": 3, "prompt": [1, 2, 3], "max_new_tokens": 4, "cache_salt": "a"}\n'
                    '{"request_id": 9, "prompt": [4294967295], "max_new_tokens": 0}\n')
    source = open_workload(path)
    described = _described(prepare_workload(source, tmp_path).requests())
    assert described == _described(source.requests())
    assert described[0][3] == "a" and described[1][1] == [4294967295]


def test_sweep_points_read_the_shared_workload(tmp_path, monkeypatch):
    parsed = []
    original = trace_sweep.prepare_workload
    monkeypatch.setattr(trace_sweep, "prepare_workload", lambda w, f: parsed.append(w) or original(w, f))
    seen = []
    real_run_point = trace_sweep.run_point
    monkeypatch.setattr(trace_sweep, "run_point", lambda p, o, prepared=None: seen.append(prepared) or
                        real_run_point(p, o, prepared))
    result = CliRunner().invoke(app, ["trace", "sweep", str(ROOT / "workloads" / "mooncake_conversation_head200.jsonl"),
                                      "--prefill-only", "--capacity", "1e4,1e5", "--tokens-per-block", "32",
                                      "--jobs", "1"])
    assert result.exit_code == 0, result.output
    assert len(parsed) == 1 and len(seen) == 2 and all(p is not None and p.folder for p in seen)
