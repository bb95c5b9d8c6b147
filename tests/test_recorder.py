"""The trace recorder (kvtool/trace/recorder.py) folds an event stream into request and iteration
rows: each test feeds it a hand-written sequence and checks every field it derives."""

from __future__ import annotations

import pytest

from kvtool.engine.events import Arrived, Cancel, Finished, LoadStarted, PassDone
from kvtool.engine.request_state import FailureReason
from kvtool.trace.recorder import TraceRecorder


def feed(recorder: TraceRecorder, *events) -> TraceRecorder:
    for event in events:
        recorder(event)
    return recorder


def test_a_request_row_takes_its_times_and_counts_from_its_passes_and_its_finish():
    recorder = feed(TraceRecorder(),
                    Arrived(0, 0.5, request_id=1, prompt_len=8, arrival=0.5),
                    PassDone(0, 1.0, items=((1, 0, 4),), seconds=0.5, pages_in_use=2, hit_tokens=4),
                    PassDone(1, 1.5, items=((1, 4, 8),), seconds=0.5, pages_in_use=3),
                    Finished(2, 2.0, request_id=1, failure=None, num_generated_tokens=3, prompt_len=8,
                             num_local_hit=2, num_external=2),
                    PassDone(2, 2.0, items=((1, 8, 9),), seconds=0.25, pages_in_use=0))
    [row] = recorder.requests
    assert (row.first_scheduled, row.first_token, row.finished) == (1.0, 2.0, 2.25)
    assert row.ttft == pytest.approx(1.5) and row.tpot == pytest.approx(0.125)
    assert (row.local_hit_tokens, row.connector_hit_tokens, row.computed_prompt_tokens) == (2, 2, 4)
    assert (row.generated_tokens, row.failure) == (3, None)
    assert [(i.iteration, i.computed_tokens, i.pages_in_use, i.hit_tokens) for i in recorder.iterations] == \
        [(0, 4, 2, 4), (1, 4, 3, 0), (2, 1, 0, 0)]
    assert recorder.unfinished == []


def test_a_row_waits_for_its_iterations_pass_which_may_still_give_it_its_first_token():
    recorder = feed(TraceRecorder(),
                    Arrived(0, 0.0, request_id=7, prompt_len=4, arrival=0.0),
                    Finished(0, 0.0, request_id=7, failure=None, num_generated_tokens=1, prompt_len=4))
    assert recorder.requests == []                       # not until its pass is done
    feed(recorder, PassDone(0, 0.0, items=((7, 0, 4),), seconds=0.3, pages_in_use=1))
    [row] = recorder.requests
    assert (row.first_scheduled, row.first_token, row.finished) == (0.0, 0.3, 0.3)
    assert row.tpot is None                              # one generated token: no time between tokens


def test_cancelled_ranges_count_per_request_and_in_total_even_for_a_request_already_gone():
    recorder = feed(TraceRecorder(),
                    Arrived(0, 0.0, request_id=1, prompt_len=64, arrival=0.0),
                    Cancel(0, 0.0, request_id=1, start=16, end=48),
                    Cancel(1, 0.1, request_id=1, start=48, end=56),
                    Cancel(1, 0.1, request_id=9, start=0, end=4))
    assert recorder.cancelled_tokens == 44
    assert [(r.request_id, r.cancelled_tokens) for r in recorder.unfinished] == [(1, 40)]


def test_only_an_asynchronous_load_marks_a_request_scheduled_before_its_first_pass():
    recorder = feed(TraceRecorder(),
                    Arrived(0, 0.0, request_id=1, prompt_len=8, arrival=0.0),
                    Arrived(0, 0.0, request_id=2, prompt_len=8, arrival=0.0),
                    LoadStarted(0, 0.2, request_id=1, num_tokens=4, is_async=True),
                    LoadStarted(0, 0.2, request_id=2, num_tokens=4, is_async=False))
    assert [(r.request_id, r.first_scheduled) for r in recorder.unfinished] == [(1, 0.2), (2, None)]


def test_a_failed_request_keeps_its_reason_and_no_first_token():
    recorder = feed(TraceRecorder(keep_iterations=False),
                    Arrived(0, 0.0, request_id=3, prompt_len=8, arrival=0.0),
                    PassDone(0, 0.0, items=((3, 0, 4),), seconds=0.1, pages_in_use=1),
                    Finished(1, 0.1, request_id=3, failure=FailureReason.ABORTED, num_generated_tokens=0,
                             prompt_len=8))
    recorder.flush()
    [row] = recorder.requests
    assert (row.failure, row.first_token, row.ttft, row.finished) == ("aborted", None, None, 0.1)
    assert recorder.iterations == []                     # keep_iterations=False keeps none


def test_events_of_requests_it_never_saw_arrive_change_nothing():
    recorder = feed(TraceRecorder(),
                    Finished(0, 0.0, request_id=5, failure=None, num_generated_tokens=1, prompt_len=4),
                    PassDone(0, 0.0, items=((5, 0, 4),), seconds=0.1, pages_in_use=1))
    assert recorder.requests == [] and recorder.unfinished == []
    assert [i.computed_tokens for i in recorder.iterations] == [4]
