"""The one stale-block rule: pinned at the window edges, against its definition, and shared by its users."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.blocks import ceil_div, num_live_blocks, stale_block_range
from kvtool.connectors.registry import load_connector
from kvtool.engine.engine import Engine, EngineConfig
from kvtool.manager import KvCacheManagerConfig
from kvtool.models import DTYPES, build_model


def stale_by_definition(history: int, tpb: int, window: int | None, sinks: int) -> list[int]:
    """Block j is stale when it holds no sink token and wholly precedes the next token's window."""
    if window is None:
        return []
    first_needed = history + 1 - window
    return [j for j in range(ceil_div(history, tpb)) if j * tpb >= sinks and (j + 1) * tpb <= first_needed]


@pytest.mark.parametrize("history, expected", [
    (0, []), (4, []),          # position 4 still attends position 1 in block 0
    (5, [0]), (6, [0]),        # block 0 (positions 0, 1) falls out of the window when position 5 comes
    (7, [0, 1]), (9, [0, 1, 2]),
])
def test_window_edges_without_sinks(history, expected):
    assert list(stale_block_range(history, 2, 4)) == expected


@pytest.mark.parametrize("history, expected", [
    (0, []), (5, []),          # block 0 holds the sink token: never stale
    (7, [1]), (9, [1, 2]), (10, [1, 2]),
])
def test_window_edges_with_one_sink_token(history, expected):
    assert list(stale_block_range(history, 2, 4, num_sink_tokens=1)) == expected


def test_sinks_spanning_more_blocks_than_the_history():
    assert list(stale_block_range(1, 2, 4, num_sink_tokens=3)) == []
    assert list(stale_block_range(11, 2, 4, num_sink_tokens=3)) == [2, 3]


def test_window_equal_to_one_block_and_full_attention():
    assert [list(stale_block_range(h, 2, 2)) for h in (2, 3, 5)] == [[], [0], [0, 1]]
    assert list(stale_block_range(10_000, 2, None, num_sink_tokens=4)) == []
    assert num_live_blocks(9, 2, 4, 1) == 5 - 2 and num_live_blocks(9, 2, None) == 5


@settings(max_examples=400, deadline=None)
@given(history=st.integers(0, 300), tpb=st.integers(1, 16), window=st.none() | st.integers(1, 64),
       sinks=st.integers(0, 20))
def test_rule_matches_its_definition(history, tpb, window, sinks):
    stale = stale_block_range(history, tpb, window, sinks)
    assert list(stale) == stale_by_definition(history, tpb, window, sinks)
    assert stale.step == 1 and stale.start <= stale.stop


def sink_model(window: int, sinks: int):
    return build_model("sinks", 4, 2, 16, DTYPES["bf16"], lambda i: None if i == 3 else window,
                       num_sink_tokens=sinks)


@settings(max_examples=25, deadline=None)
@given(window=st.integers(1, 24), sinks=st.integers(0, 9), tpb=st.sampled_from([1, 2, 4, 8]),
       histories=st.lists(st.integers(0, 200), min_size=1, max_size=20))
def test_connector_view_and_manager_cannot_disagree(window, sinks, tpb, histories):
    """What a connector learns through `LlmArgs.layer_groups` is what the manager does."""
    config = EngineConfig(KvCacheManagerConfig(sink_model(window, sinks), tpb, num_slots=8, device="cpu"))
    engine = Engine(config)
    args = engine.llm_args(load_connector("host"), {}, rank=0)
    assert len(args.layer_groups) == len(engine.manager.layer_groups)
    for info, group in zip(args.layer_groups, engine.manager.layer_groups, strict=True):
        assert (info.window_size, info.num_sink_tokens) == (group.window_size, group.num_sink_tokens)
        for h in histories:
            assert info.stale_range(h, tpb) == group.stale_range(h, tpb)
            assert list(info.stale_range(h, tpb)) == stale_by_definition(h, tpb, info.window_size,
                                                                         info.num_sink_tokens)
