"""A timeline of a replay in the Chrome trace event format (load it in Perfetto or chrome://tracing).

One track per request (process "requests", thread = request id): a span for the whole request,
inside it `queued` (arrival to first pass), `loading` (a connector load), one span per prefill
chunk, one `decode` span over its generation steps, `paused` (from a pause by MAX_UTILIZATION to
its replay's next pass; its replay's prefill chunks follow), `save` (an asynchronous save after it
finished), and instants for `ask`, `reserve` and `finished`. Process "engine" carries counters per
iteration: pages in use and hit tokens. Times are the replay's simulated clock, in microseconds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from kvtool.engine.events import (
    Arrived,
    Ask,
    EngineEvent,
    Finished,
    LoadFinished,
    LoadStarted,
    PassDone,
    Paused,
    Reserve,
    SaveFinished,
    SaveStarted,
)
from kvtool.report.run_folder import write_file

REQUESTS_PID, ENGINE_PID = 1, 0


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


@dataclass
class _Track:
    request_id: int
    arrival: float
    prompt_len: int
    first_pass: float | None = None
    load_start: float | None = None
    decode: list[float] = field(default_factory=list)
    """[start, end, steps] of the running decode span."""
    end: float = 0.0
    finished: float | None = None
    saving: float | None = None
    paused: float | None = None


class TimelineRecorder:
    """An event subscriber that builds the timeline as the replay runs; `write(path)` after it."""

    event_kinds = frozenset({PassDone, Arrived, Ask, Reserve, LoadStarted, LoadFinished, Finished, SaveStarted,
                             SaveFinished, Paused})

    def __init__(self, max_requests: int | None = None) -> None:
        self.events: list[dict] = []
        self.max_requests = max_requests
        self._tracks: dict[int, _Track] = {}
        self._num_tracks = 0

    def __call__(self, event: EngineEvent) -> None:
        kind = type(event)
        if kind is PassDone:   # (`kind is`, not isinstance: the cheaper test; cast for the type checker)
            self._pass(cast(PassDone, event))
            return
        if kind is Arrived:
            if self.max_requests is None or self._num_tracks < self.max_requests:
                arrived = cast(Arrived, event)
                self._tracks[arrived.request_id] = _Track(arrived.request_id, arrived.arrival, arrived.prompt_len)
                self._num_tracks += 1
            return
        request_id = getattr(event, "request_id", None)
        track = self._tracks.get(request_id) if request_id is not None else None
        if track is None:
            return
        if kind is Ask or kind is Reserve:
            self._instant(track, kind.__name__.lower(), event.clock)
        elif kind is LoadStarted:
            self._started(track, event.clock)
            track.load_start = event.clock
        elif kind is LoadFinished and track.load_start is not None:
            self._span(track, "loading", track.load_start, max(event.clock, track.load_start))
            track.load_start = None
        elif kind is Finished:
            track.finished = event.clock
        elif kind is Paused:
            self._end_decode(track)
            track.paused, track.prompt_len = event.clock, cast(Paused, event).context_len
        elif kind is SaveStarted:
            track.saving = event.clock
        elif kind is SaveFinished and track.saving is not None:
            # the engine stamps a save with the clock of the pass that finished the request, which
            # ends later: the save runs after that pass
            start = max(track.saving, track.end)
            self._span(track, "save", start, max(event.clock, start))
            track.end = max(track.end, event.clock)
            self._close(track)

    def _pass(self, event: PassDone) -> None:
        end = event.clock + event.seconds
        for request_id, start, stop in event.items:
            track = self._tracks.get(request_id)
            if track is None:
                continue
            self._started(track, event.clock)
            if track.paused is not None:
                self._span(track, "paused", track.paused, event.clock)
                track.paused = None
            if track.load_start is not None:   # a synchronous load lands in this pass
                self._span(track, "loading", track.load_start, end)
                track.load_start = None
            if stop <= track.prompt_len:
                self._span(track, f"prefill [{start}, {stop})", event.clock, end)
            elif track.decode:
                track.decode[1], track.decode[2] = end, track.decode[2] + 1
            else:
                track.decode = [event.clock, end, 1]
            track.end = end
        self.events.append({"name": "pages in use", "ph": "C", "ts": _us(event.clock), "pid": ENGINE_PID,
                            "args": {"pages": event.pages_in_use}})
        self.events.append({"name": "hit tokens", "ph": "C", "ts": _us(event.clock), "pid": ENGINE_PID,
                            "args": {"tokens": event.hit_tokens}})
        for track in [t for t in self._tracks.values() if t.finished is not None and t.saving is None]:
            self._close(track)

    def _started(self, track: _Track, at: float) -> None:
        """Its first pass or load begins: the queued span ends."""
        if track.first_pass is None:
            track.first_pass = at
            self._span(track, "queued", track.arrival, at)

    def _end_decode(self, track: _Track) -> None:
        if track.decode:
            self._span(track, f"decode ({track.decode[2]} steps)", track.decode[0], track.decode[1])
            track.decode = []

    def _close(self, track: _Track) -> None:
        self._end_decode(track)
        finished = max(track.finished or 0.0, track.end)
        self._instant(track, "finished", finished)
        self._span(track, f"request {track.request_id}", track.arrival, max(finished, track.end))
        del self._tracks[track.request_id]

    def _span(self, track: _Track, name: str, start: float, end: float) -> None:
        self.events.append({"name": name, "ph": "X", "ts": _us(start), "dur": _us(max(end - start, 0.0)),
                            "pid": REQUESTS_PID, "tid": track.request_id})

    def _instant(self, track: _Track, name: str, at: float) -> None:
        self.events.append({"name": name, "ph": "i", "s": "t", "ts": _us(at), "pid": REQUESTS_PID,
                            "tid": track.request_id})

    def write(self, path: Path) -> None:
        """The trace file; requests still open (the replay failed) end at their last pass."""
        for track in list(self._tracks.values()):
            self._close(track)
        names = [{"name": "process_name", "ph": "M", "pid": ENGINE_PID, "args": {"name": "engine"}},
                 {"name": "process_name", "ph": "M", "pid": REQUESTS_PID, "args": {"name": "requests"}}]
        write_file(path, json.dumps({"traceEvents": names + self.events, "displayTimeUnit": "ms"}))
