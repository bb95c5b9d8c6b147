import dataclasses
import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.trace.replay import TraceSummary

runner = CliRunner()
WORKLOAD = "workloads/shared_prefix.jsonl"


def trace(*args):
    return runner.invoke(app, ["trace", "run", *args])


def small_workload(tmp_path, lines=None):
    path = tmp_path / "w.jsonl"
    shared = list(range(500, 564))
    lines = lines or [{"request_id": i, "prompt": shared + [i] * (5 + i), "max_new_tokens": 3, "arrival": i * 0.05}
                      for i in range(5)]
    path.write_text("\n".join(json.dumps(line) if isinstance(line, dict) else line for line in lines) + "\n")
    return path


def test_json_summary_has_the_documented_keys(tmp_path):
    out = tmp_path / "s.json"
    result = trace(str(small_workload(tmp_path)), "--tokens-per-block", "16", "--json", str(out))
    assert result.exit_code == 0, result.output
    summary = json.loads(out.read_text())
    assert list(summary) == [f.name for f in dataclasses.fields(TraceSummary)]
    assert summary["num_requests"] == 5 and summary["integrity_errors"] == 0
    assert summary["local_hit_tokens"] == 4 * 64 and summary["connector_hit_tokens"] == 0


def test_the_shipped_workload_runs_with_the_host_connector(tmp_path):
    out = tmp_path / "s.json"
    result = trace(WORKLOAD, "--connector", "host", "--no-local-reuse", "--json", str(out))
    assert result.exit_code == 0, result.output
    summary = json.loads(out.read_text())
    assert summary["connector_hit_tokens"] > 4000 and summary["local_hit_tokens"] == 0
    assert summary["integrity_errors"] == 0 and summary["saved_blocks"] > 0


def test_disk_cache_persists_across_processes(tmp_path):
    workload = small_workload(tmp_path)
    cache = tmp_path / "cache"
    summaries = []
    for run in range(2):
        out = tmp_path / f"run{run}.json"
        done = subprocess.run([sys.executable, "-m", "kvtool", "trace", "run", str(workload), "--tokens-per-block",
                               "16", "--connector", "disk", "--connector-dir", str(cache), "--no-local-reuse",
                               "--json", str(out)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        summaries.append(json.loads(out.read_text()))
    first, second = summaries
    prompts = [64 + 5 + i for i in range(5)]
    every_full_block = sum(min(p // 16 * 16, p - 1) for p in prompts)
    assert first["connector_hit_tokens"] == 4 * 64      # within the first run: the shared prefix only
    assert second["connector_hit_tokens"] == every_full_block and second["saved_blocks"] == 0
    assert second["computed_tokens"] == sum(prompts) - every_full_block + 5 * 2
    assert first["integrity_errors"] == second["integrity_errors"] == 0


def test_a_broken_connector_file_exits_1_with_the_coordinates(tmp_path):
    connector = tmp_path / "broken.py"
    connector.write_text(
        "from kvtool.connectors.host import HostConnectorScheduler, HostConnectorWorker\n"
        "class Worker(HostConnectorWorker):\n"
        "    def load(self, transfers, layer_id=None):\n"
        "        super().load([type(t)(t.request_id, t.layer_group_id, t.block_ordinal, t.page, "
        "(t.location[0], 0), t.key) for t in transfers], layer_id)\n")
    result = trace(str(small_workload(tmp_path)), "--tokens-per-block", "16", "--no-local-reuse",
                   "--connector", f"{connector}:HostConnectorScheduler:Worker")
    assert result.exit_code == 1
    assert "integrity errors" in result.stderr and "layer group 0, block" in result.output


@pytest.mark.parametrize("line, message", [
    ("{not json", "line 2: not valid JSON"),
    ('{"request_id": 9, "prompt": [], "max_new_tokens": 1}', "line 2: prompt must be a non-empty list"),
    ('{"request_id": 9, "prompt": [1, -2], "max_new_tokens": 1}', "line 2: prompt holds -2"),
    ('{"request_id": 0, "prompt": [1], "max_new_tokens": 1}', "line 2: request_id 0 appears twice"),
    ('{"request_id": 9, "prompt": [1]}', "line 2: missing field 'max_new_tokens'"),
    ('{"request_id": 9, "prompt": [1], "max_new_tokens": 1, "arival": 3}', "line 2: unknown field(s) arival"),
    ('{"request_id": 9, "prompt": [1], "max_new_tokens": 1, "cache_salt": 4}', "line 2: cache_salt must be"),
    ('[1, 2]', "line 2: each line must be a JSON object"),
])
def test_malformed_workload_lines_are_named_and_exit_2(tmp_path, line, message):
    path = small_workload(tmp_path, [{"request_id": 0, "prompt": [1, 2], "max_new_tokens": 1}, line])
    result = trace(str(path))
    assert result.exit_code == 2 and message in result.stderr and "Traceback" not in result.output


@pytest.mark.parametrize("args, message", [
    (["missing.jsonl"], "cannot read workload"),
    ([WORKLOAD, "--connector", "nope"], "connector 'nope'"),
    ([WORKLOAD, "--connector", "no.such.module:A:B"], "cannot import no.such.module"),
    ([WORKLOAD, "--connector", "kvtool.connectors.host:Missing:HostConnectorWorker"], "has no class Missing"),
    ([WORKLOAD, "--model", "llama-9"], "unknown model"),
    ([WORKLOAD, "--num-slots", "2"], "KV cache is too small"),
    ([WORKLOAD, "--chunk-size", "0"], "--chunk-size must be positive"),
    ([WORKLOAD, "--connector", "host", "--connector-opt", "capacity"], "is not KEY=VALUE"),
    ([WORKLOAD, "--connector", "host", "--connector-opt", "capacity=1"], "below one block"),
])
def test_bad_input_exits_2_with_one_line(args, message):
    result = trace(*args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "Traceback" not in result.output
