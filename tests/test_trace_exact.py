"""The replay decides exactly what kvtool decided before its speed work (commit a6e596d): the
200-request slice of the Mooncake conversation trace, replayed at four page sizes, pools and
tiers (evictions, deferrals, tier hits, partial blocks at 48 tokens a block), gives the same
counts, hit rate and simulated clock as that commit recorded in tests/data."""

import json
from pathlib import Path

import pytest

from benchmarks.replay_child import replay

ROOT = Path(__file__).resolve().parents[1]
RECORDED = json.loads((ROOT / "tests" / "data" / "trace_counts_a6e596d.json").read_text())
SLICE = ROOT / "workloads" / "mooncake_conversation_head200.jsonl"


@pytest.mark.parametrize("run", RECORDED["runs"], ids=lambda r: f"{r['tokens_per_block']}tpb-{r['num_slots']}-"
                         f"{r['connector']}")
def test_the_slice_replays_to_the_counts_of_a6e596d(run):
    row = replay(SLICE, run["tokens_per_block"], run["num_slots"], run["connector"], run["capacity"])
    assert row["counts"] == run["counts"]
