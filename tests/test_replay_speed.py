"""The replay benchmark script: rows per leading fraction, and its run folder."""

import json

from helpers.traces import random_mooncake_trace
from kvtool.cli.replay_speed import main


def test_it_replays_each_fraction_and_the_shipped_workload(tmp_path, capsys):
    trace = tmp_path / "m.jsonl"
    random_mooncake_trace(trace, 40, 512, seed=1)
    assert main([str(trace), "--fractions", "1,0.25", "--output", str(tmp_path / "out")]) == 0
    rows = json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
    assert [r["requests"] for r in rows] == [10, 40, 24]
    assert [r["fidelity"] for r in rows] == ["blocks", "blocks", "bytes"]
    assert all(r["tokens_per_second"] > 0 and not r["failed_checks"] for r in rows)
    assert (tmp_path / "out" / "meta.json").is_file() and len(capsys.readouterr().out.splitlines()) == 3
