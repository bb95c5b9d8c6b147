"""Pausing as TensorRT-LLM's V2 does it under MAX_UTILIZATION: the running request started last gives
its allocation back so that an earlier one can grow; the connector hears `request_finished` early;
the replay recomputes its tokens so far (less what the radix tree or the connector serves), is asked
again, and is reported in `new_requests` with its whole block list."""

from __future__ import annotations

from kvtool.connector.loader import load_connector
from kvtool.connector.request import Request
from kvtool.engine.events import EventLog, Paused
from kvtool.engine.request_state import Phase
from kvtool.validate.harness import Context
from kvtool.validate.pause_scenarios import pause_replay
from tests.helpers.engines import make_engine, sched, scripted

PAUSING = "tests/helpers/broken_pause_connectors.py:KeepsPagesAcrossPause:DictConnectorWorker"


def _growing(engine, n=4, prompt=10, new=12):
    for i in range(n):
        engine.add_request(Request(i, [i * 100 + t for t in range(prompt)], new))


def test_the_request_started_last_is_paused_and_replays_to_the_same_tokens():
    reference = make_engine(num_slots=64)
    _growing(reference)
    reference.run()
    engine = make_engine(scripted(lambda r, n: (0, False)), num_slots=12, pause_to_grow=True)
    log = EventLog()
    engine.events.subscribe(log)
    _growing(engine)
    engine.run()
    paused = [(e.request_id, e.num_computed_tokens, e.context_len) for e in log.of(Paused)]
    assert paused == [(3, 12, 13), (2, 16, 17)]        # LIFO: the latest started first
    assert engine.stats.num_pauses == 2 and engine.integrity_errors == 0 and engine.stats.num_failed == 0
    assert engine.stats.recomputed_tokens == 28          # 12 + 16, nothing reused (the pool is too full)
    for rid in range(4):
        assert engine.states[rid].phase is Phase.DONE
        assert engine.states[rid].request.generated_token_ids == reference.states[rid].request.generated_token_ids


def test_the_connector_hears_request_finished_early_and_the_replay_is_asked_again_and_reported_new():
    engine = make_engine(scripted(lambda r, n: (0, False)), num_slots=12, pause_to_grow=True)
    _growing(engine)
    engine.run()
    calls = [c[:2] for c in sched(engine).calls if c[0] in ("ask", "finished", "alloc")]
    assert calls.count(("ask", 3)) == 2 and calls.count(("finished", 3)) == 2 and calls.count(("alloc", 3)) == 2
    first_finish = calls.index(("finished", 3))
    assert calls[first_finish + 1:].index(("ask", 3)) >= 0     # asked again after the early request_finished
    news = [(i, d) for i, out in enumerate(sched(engine).outputs) for d in out.new_requests if d.request_id == 3]
    assert len(news) == 2
    replay = news[1][1]
    assert replay.computed_position == 0 and len(replay.new_tokens) == 13   # the prompt and one generated token
    assert len(replay.new_block_ids) == 4 and 12 <= replay.num_scheduled_tokens <= 13   # its whole block list


def test_without_pausing_greedy_admission_runs_out_of_pages():
    import pytest

    from kvtool.errors import OutOfPagesError
    engine = make_engine(scripted(lambda r, n: (0, False)), num_slots=12)
    _growing(engine)
    with pytest.raises(OutOfPagesError, match="--admission max-utilization"):
        engine.run()


def test_pause_replay_passes_the_example_and_catches_a_connector_keeping_old_page_indices():
    good = pause_replay(Context(load_connector("examples/dict_connector.py:DictConnectorScheduler:DictConnectorWorker",
                                               {}), "tiny"))
    assert [r.verdict.value for r in good] == ["pass", "pass"] and "paused: request 2 1x" in good[0].evidence[0]
    bad = pause_replay(Context(load_connector(PAUSING, {}), "tiny"))
    assert bad[0].verdict.value == "fail" and "request 12, layer group 0, block 0" in bad[0].evidence[0]


PAGE_TABLE = "tests/helpers/broken_pause_connectors.py:NamesBlocksByOrdinal:PageTableWorker"


def test_pause_replay_catches_a_worker_page_table_that_keeps_a_replayed_requests_first_block_list():
    """Issue 25: the worker's page table (request id -> pages) takes an id's first `new_requests`
    report and then only `cached_requests` deltas; the replay, reported new with a new block list,
    saves its recomputed block from the old page (someone else's now) under its key, and the repeat
    of its conversation loads those bytes. Every other scenario passes as the example does."""
    import re

    from kvtool.validate.runner import run_all
    from kvtool.validate.scenarios import SCENARIOS
    spec = load_connector(PAGE_TABLE, {})
    results = run_all([Context(spec, m) for m in ("tiny", "tiny-vswa")], list(SCENARIOS), 60,
                      isolated=False)
    assert {(r.scenario, r.model, r.check) for r in results if r.failed} == \
        {("pause-replay", "tiny", "integrity"), ("pause-replay", "tiny-vswa", "integrity")}
    for r in results:
        if r.scenario == "pause-replay" and r.check == "integrity":
            # the replay runs in other pages and is loaded by the connector (issue 39): its own loads,
            # written into the old pages, are caught first, before the repeat loads the bad save
            assert re.match(r"request 2, layer group \d, block \d, .*: mismatch .*loaded by the connector",
                            r.evidence[0]), r.evidence[:2]
        if r.scenario == "pause-replay" and r.check == "warm-hit":
            assert r.verdict.value == "miss" and "bytes it loaded were wrong" in r.evidence[0]


def test_the_page_table_worker_passes_pause_replay_once_it_takes_the_replays_new_report():
    """The failure above is the ignored report and nothing else: the same worker taking every
    `new_requests` report whole passes."""
    from dataclasses import replace
    spec = load_connector(PAGE_TABLE, {})

    class TakesEveryNewReport(spec.worker_class):
        def start_load_kv(self, stream):
            for rid, is_new, _ in self._metadata.reports:
                if is_new:
                    self._pages.pop(rid, None)
            super().start_load_kv(stream)

    for model in ("tiny", "tiny-vswa"):
        fixed = pause_replay(Context(replace(spec, worker_class=TakesEveryNewReport), model))
        assert [r.verdict.value for r in fixed] == ["pass", "pass"] and "request 2 1x" in fixed[0].evidence[0]
