"""The engine's typed event stream: which events, in which order, with which exact values."""

from __future__ import annotations

from dataclasses import replace

from kvtool.connector.request import Request
from kvtool.engine.events import (
    Arrived,
    Ask,
    Cancel,
    Deliver,
    EventLog,
    EventStream,
    Evicted,
    Finished,
    LoadFinished,
    LoadStarted,
    PassDone,
    Reserve,
    SaveFinished,
    SaveStarted,
)
from kvtool.engine.request_state import FailureReason
from tests.helpers.engines import make_engine, scripted


def logged(engine):
    log = EventLog()
    engine.events.subscribe(log)
    return log


def without_stamps(events):
    """The protocol events, unstamped (Arrived and PassDone, which bracket every request and
    pass, have their own tests)."""
    return [replace(e, iteration=0, clock=0.0) for e in events if not isinstance(e, (Arrived, PassDone))]


def without_stamps_kept(events):
    return [e for e in events if not isinstance(e, (Arrived, PassDone))]


def test_a_sync_load_from_ask_to_finish():
    engine = make_engine(scripted(lambda r, n: (r.prompt_len - n, False)))
    log = logged(engine)
    engine.add_request(Request(1, list(range(12)), 2))
    engine.run()
    stamp = {"iteration": 0, "clock": 0.0}
    assert without_stamps(log.events) == [
        Ask(**stamp, request_id=1, num_computed_tokens=0, num_offered_tokens=11, is_async=False),
        Cancel(**stamp, request_id=1, start=11, end=12),          # the clamp: the last position is computed
        Reserve(**stamp, request_id=1, start=0, end=11, ok=True),
        Deliver(**stamp, request_id=1, num_external=11, num_local_hit=0),
        LoadStarted(**stamp, request_id=1, num_tokens=11, is_async=False),
        LoadFinished(**stamp, request_id=1),
        Finished(**stamp, request_id=1, failure=None, num_generated_tokens=2, prompt_len=12, num_external=11),
    ]
    assert [(type(e).__name__, e.iteration) for e in log.events if isinstance(e, (Arrived, PassDone))] == \
        [("Arrived", 0), ("PassDone", 1), ("PassDone", 2)]
    first, second = [e for e in log.events if isinstance(e, PassDone)]
    assert (first.items, first.hit_tokens, second.items, second.hit_tokens) == (((1, 11, 12),), 11, ((1, 12, 13),), 0)
    assert first.seconds == second.seconds == 0.01
    assert [e.iteration for e in without_stamps_kept(log.events)] == [1, 1, 1, 1, 1, 1, 2]
    assert log.events[-1].clock > log.events[0].clock


def test_an_async_load_lands_in_a_later_iteration_and_an_async_save_is_bracketed():
    engine = make_engine(scripted(lambda r, n: (8, True), finish_async=True))
    log = logged(engine)
    engine.add_request(Request(1, list(range(12)), 1))
    engine.run()
    (started,), (landed,) = log.of(LoadStarted), log.of(LoadFinished)
    assert started.is_async and started.num_tokens == 8 and landed.iteration > started.iteration
    (save,), (saved,) = log.of(SaveStarted), log.of(SaveFinished)
    (finished,) = log.of(Finished)
    assert finished.iteration <= save.iteration <= saved.iteration
    assert log.events.index(finished) < log.events.index(save) < log.events.index(saved)


def test_a_reserve_that_finds_no_pages_is_reported_and_cancels_the_offer():
    spec = scripted(lambda r, n: (11, False) if r.request_id == 2 else (0, False))
    engine = make_engine(spec, num_slots=3, chunk_size=4)
    log = logged(engine)
    engine.add_request(Request(1, list(range(100, 108)), 1))
    engine.add_request(Request(2, list(range(12)), 1))
    engine.run()
    reserves = [e for e in log.of(Reserve) if e.request_id == 2]
    assert [(e.start, e.end, e.ok) for e in reserves] == [(0, 11, False)]
    assert [(e.start, e.end) for e in log.of(Cancel) if e.request_id == 2] == [(0, 11)]
    assert not [e for e in log.of(Deliver) if e.request_id == 2 and e.num_external]


def test_a_failure_carries_its_reason():
    engine = make_engine(scripted(lambda r, n: (8, True)), max_transmission_iterations=2)
    for worker in engine.connector.workers:
        worker.delay = 10**6       # never lands
    log = logged(engine)
    engine.add_request(Request(1, list(range(12)), 1))
    engine.run()
    (finished,) = log.of(Finished)
    assert finished.failure is FailureReason.STUCK_IN_TRANSMISSION
    assert not log.of(LoadFinished)


def test_every_eviction_is_an_event():
    engine = make_engine(None, num_slots=4)
    log = logged(engine)
    for i in range(4):
        engine.add_request(Request(i, [i * 100 + t for t in range(8)], 1, arrival=i))
    engine.run()
    evictions = log.of(Evicted)
    assert len(evictions) == engine.manager.page_table.num_evictions > 0
    assert all(e.layer_group_id == 0 and 0 <= e.block_ordinal < 2 for e in evictions)


def test_a_stream_fans_out_in_subscription_order():
    stream, seen = EventStream(), []
    assert not stream.active
    stream.subscribe(lambda e: seen.append(("a", e)))
    stream.subscribe(lambda e: seen.append(("b", e)))
    event = Cancel(iteration=1, clock=0.0, request_id=3, start=0, end=4)
    stream.emit(event)
    assert seen == [("a", event), ("b", event)]
