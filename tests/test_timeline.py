"""`--timeline`: a Chrome trace event file whose spans nest per request."""

import json
from collections import defaultdict

import pytest
from helpers.traces import random_mooncake_trace
from typer.testing import CliRunner

from kvtool.cli import app

runner = CliRunner()
EPSILON = 1e-3   # microseconds: the file rounds times to nanoseconds


def contains(outer, inner):
    return outer["ts"] - EPSILON <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + EPSILON


def disjoint(a, b):
    return a["ts"] + a["dur"] <= b["ts"] + EPSILON or b["ts"] + b["dur"] <= a["ts"] + EPSILON


def timeline(tmp_path, *args):
    path = tmp_path / "timeline.json"
    result = runner.invoke(app, ["trace", "run", *map(str, args), "--timeline", str(path)])
    assert result.exit_code == 0, result.output
    return json.loads(path.read_text())["traceEvents"]


@pytest.mark.parametrize("args", [
    ["workloads/shared_prefix.jsonl", "--connector", "host", "--no-local-reuse", "--connector-opt", "mode=async"],
    ["workloads/shared_prefix.jsonl", "--chunk-size", "64"],
    ["IMPORTED", "--source-block-size", "64", "--tokens-per-block", "16", "--connector", "index",
     "--max-batch-size", "4"],
])
def test_every_requests_spans_nest_inside_its_track(tmp_path, args):
    if args[0] == "IMPORTED":
        random_mooncake_trace(tmp_path / "m.jsonl", 30, 64, seed=2)
        args = [tmp_path / "m.jsonl", *args[1:]]
    events = timeline(tmp_path, *args)
    tracks = defaultdict(list)
    for event in events:
        if event["ph"] in ("X", "i") and event["pid"] == 1:
            tracks[event["tid"]].append(event)
    with open(args[0]) as workload:
        num_requests = sum(1 for _ in workload)
    assert sorted(tracks) == list(range(num_requests))
    for request_id, track in tracks.items():
        (whole,) = [e for e in track if e["name"] == f"request {request_id}"]
        names = [e["name"] for e in track]
        assert names.count("finished") == 1 and "queued" in names and any(n.startswith("prefill") for n in names)
        assert names.count("reserve") <= names.count("ask")
        spans = [e for e in track if e["ph"] == "X" and e is not whole]
        for event in track:
            event.setdefault("dur", 0.0)
            assert contains(whole, event), (request_id, event)
        for i, a in enumerate(spans):
            for b in spans[i + 1:]:
                assert disjoint(a, b) or contains(a, b) or contains(b, a), (request_id, a, b)


def test_the_engine_track_counts_pages_and_hits_every_iteration(tmp_path):
    events = timeline(tmp_path, "workloads/shared_prefix.jsonl")
    pages = [e for e in events if e["name"] == "pages in use"]
    hits = [e for e in events if e["name"] == "hit tokens"]
    assert len(pages) == len(hits) > 0 and all(e["ph"] == "C" and e["pid"] == 0 for e in pages + hits)
    assert max(e["args"]["pages"] for e in pages) > 0 and sum(e["args"]["tokens"] for e in hits) > 0
    assert [e["ts"] for e in pages] == sorted(e["ts"] for e in pages)
