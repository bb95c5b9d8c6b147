"""`kvtool trace generate`: synthetic chat, document-QA and agentic workloads."""

import json

import pytest
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.workloads.generate import GeneratorConfig, generate
from kvtool.workloads.source import load_workload

runner = CliRunner()
SMALL = ["--prefix-tokens", "64", "--turn-tokens", "16", "--output-tokens", "4"]


def generated(tmp_path, kind, *args, name="w.jsonl"):
    path = tmp_path / name
    result = runner.invoke(app, ["trace", "generate", kind, "--output", str(path), *SMALL, *args])
    assert result.exit_code == 0, result.output
    return path


def test_the_same_seed_writes_the_same_file_and_another_seed_another(tmp_path):
    one = generated(tmp_path, "chat", "--requests", "30", name="a.jsonl").read_bytes()
    assert generated(tmp_path, "chat", "--requests", "30", name="b.jsonl").read_bytes() == one
    assert generated(tmp_path, "chat", "--requests", "30", "--seed", "1", name="c.jsonl").read_bytes() != one


def test_a_chat_turn_extends_the_previous_turn_of_its_conversation():
    config = GeneratorConfig("chat", num_requests=40, prefix_tokens=64, turn_tokens=16, output_tokens=4, turns=3,
                             think_seconds=100.0, rate=1.0)
    requests = list(generate(config))
    arrivals = [a for a, _ in requests]
    assert arrivals == sorted(arrivals) and len(requests) == 40
    lengths = sorted({len(p) for _, p in requests})
    assert lengths == [64 + 16, 64 + 16 + 4 + 16, 64 + 2 * (16 + 4) + 16]
    system = requests[0][1][:64]
    assert all(p[:64] == system for _, p in requests)
    by_length = {}
    for _, prompt in requests:
        by_length.setdefault(len(prompt), []).append(prompt)
    # every second turn starts with the whole first turn of some conversation
    firsts = {tuple(p) for p in by_length[80]}
    assert all(tuple(p[:80]) in firsts for p in by_length[100])


def test_docqa_repeats_popular_documents():
    config = GeneratorConfig("docqa", num_requests=200, prefix_tokens=64, turn_tokens=8, documents=10)
    documents = [tuple(p[64:128]) for _, p in generate(config)]   # after the 64-token system prompt
    counts = sorted((documents.count(d) for d in set(documents)), reverse=True)
    assert 2 < len(counts) <= 10 and counts[0] > counts[-1] and counts[0] > 200 / 10


@pytest.mark.parametrize("kind", ["chat", "docqa", "agentic"])
def test_each_kind_replays_with_reuse(tmp_path, kind):
    path = generated(tmp_path, kind, "--requests", "24", "--rate", "20")
    assert len(load_workload(path)) == 24
    result = runner.invoke(app, ["trace", "run", str(path), "--tokens-per-block", "16", "--format", "json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["hit_rate"] > 0.3 and summary["integrity_errors"] == 0


@pytest.mark.parametrize("args, message", [
    (["party"], "unknown workload kind 'party'"),
    (["chat", "--requests", "0"], "--requests must be >= 1"),
    (["chat", "--rate", "0"], "--rate and --zipf must be > 0"),
    (["chat", "--output-tokens", "-1"], "--output-tokens must be >= 0"),
])
def test_bad_knobs_exit_2_and_leave_an_earlier_file_whole(tmp_path, args, message):
    path = tmp_path / "w.jsonl"
    path.write_text("earlier\n")
    result = runner.invoke(app, ["trace", "generate", *args, "--output", str(path)])
    assert result.exit_code == 2 and message in result.stderr and "Traceback" not in result.output
    assert path.read_text() == "earlier\n" and not (tmp_path / "w.jsonl.partial").exists()
