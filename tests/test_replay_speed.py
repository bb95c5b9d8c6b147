"""The replay benchmark script: rows per leading fraction, and its run folder."""

import json
from pathlib import Path

from helpers.traces import random_mooncake_trace

from benchmarks.replay_speed import main


def test_it_replays_each_fraction_and_the_shipped_workload(tmp_path, capsys):
    trace = tmp_path / "m.jsonl"
    random_mooncake_trace(trace, 40, 512, seed=1)
    assert main([str(trace), "--fractions", "1,0.25", "--output", str(tmp_path / "out")]) == 0
    rows = json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
    assert [r["requests"] for r in rows] == [10, 40, 24]
    assert [r["fidelity"] for r in rows] == ["blocks", "blocks", "bytes"]
    assert all(r["tokens_per_second"] > 0 and not r["failed_checks"] for r in rows)
    # Three replays and a median line for each of the two fractions (and the largest one's segments).
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (tmp_path / "out" / "meta.json").is_file() and len([x for x in lines if "segment" not in x]) == 5


def test_repeats_interleave_the_fractions_and_report_medians(tmp_path):
    trace = tmp_path / "m.jsonl"
    random_mooncake_trace(trace, 20, 512, seed=2)
    assert main([str(trace), "--fractions", "0.5,1", "--repeats", "2", "--output", str(tmp_path / "out")]) == 0
    document = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [(r["requests"], r.get("repeat")) for r in document["rows"]] == [(10, 0), (20, 0), (10, 1), (20, 1),
                                                                             (24, None)]
    medians = {m["run"]: m for m in document["medians"]}
    assert [m["repeats"] for m in medians.values()] == [2, 2]
    for run, m in medians.items():
        seconds = sorted(r["seconds"] for r in document["rows"] if r["run"] == run)
        assert m["seconds"] == round(sum(seconds) / 2, 3)


def test_the_largest_replay_is_cut_into_segments_of_equal_prompt_tokens(tmp_path):
    trace = tmp_path / "m.jsonl"
    random_mooncake_trace(trace, 40, 512, seed=3)
    assert main([str(trace), "--fractions", "0.5,1", "--segments", "4", "--repeats", "2",
                 "--output", str(tmp_path / "out")]) == 0
    document = json.loads((tmp_path / "out" / "results.json").read_text())
    segments = document["segments"]
    largest = next(r for r in document["rows"] if r["requests"] == 40 and r["repeat"] == 0)
    assert [s["segment"] for s in segments] == [1, 2, 3, 4]
    assert sum(s["prompt_tokens"] for s in segments) == largest["prompt_tokens"]
    # A part ends after the iteration whose finished requests reach its quarter of the tokens.
    assert all(s["prompt_tokens"] > 0 for s in segments)
    assert all(s["us_per_block"] > 0 and 0 <= s["hit_rate"] <= 1 for s in segments)
    assert (tmp_path / "out" / "segments.csv").read_text().splitlines()[0] == \
        "segment,prompt_tokens,us_per_block,hit_rate"


def test_versus_compares_two_trees_and_times_the_command_line(tmp_path):
    """This tree against itself on 20 requests: counts equal, a library replay and a `kvtool trace
    run` timed for each tree, the machine's CPU and load in meta.json."""
    from benchmarks import replay_versus

    root = Path(__file__).resolve().parents[1]
    head = tmp_path / "head.jsonl"
    head.write_text("".join((root / "workloads" / "mooncake_conversation_head200.jsonl").read_text()
                            .splitlines(keepends=True)[:20]))
    assert replay_versus.main([str(head), "--baseline", str(root), "--fractions", "1",
                               "--output", str(tmp_path / "out")]) == 0
    rows = json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
    assert [r["tree"] for r in rows] == ["this", "baseline"] and all(r["counts_match"] for r in rows)
    assert all(r["cli_seconds"] > 0 and r["cli_cpu_seconds"] > 0 and r["cli_peak_rss_mb"] > 0 for r in rows)
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert "load_average" in meta and "cpu_model" in meta
