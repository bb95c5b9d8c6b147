"""What a replay records, folded from the event stream as it runs: a row per request, a row per
iteration, and totals. Nothing grows with the number of events (an eviction is counted, not kept),
so a replay of any length records in the memory of its rows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvtool.engine.events import Arrived, Cancel, EngineEvent, Finished, LoadStarted, PassDone


@dataclass
class RequestRow:
    """One request's replay, in simulated seconds. Token counts are prompt tokens."""

    request_id: int
    arrival: float
    prompt_len: int
    local_hit_tokens: int = 0
    connector_hit_tokens: int = 0
    computed_prompt_tokens: int = 0
    cancelled_tokens: int = 0
    generated_tokens: int = 0
    first_scheduled: float | None = None
    """When its first pass (or asynchronous load) began."""
    first_token: float | None = None
    """When the pass that computed its last prompt position ended: the first token's time."""
    finished: float | None = None
    failure: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (draft tokens shorten it: several a step)."""
        if self.first_token is None or self.finished is None or self.generated_tokens < 2:
            return None
        return (self.finished - self.first_token) / (self.generated_tokens - 1)

    def as_dict(self) -> dict:
        return {**asdict(self), "ttft": self.ttft, "tpot": self.tpot}


@dataclass
class IterationRow:
    iteration: int
    start: float
    seconds: float
    num_requests: int
    computed_tokens: int
    pages_in_use: int
    hit_tokens: int
    """Prompt tokens served from a cache (local or connector) to the requests that started in it."""


class TraceRecorder:
    """An event subscriber; read `requests`, `iterations` and the totals after the replay."""

    event_kinds = frozenset({PassDone, Arrived, Cancel, LoadStarted, Finished})

    def __init__(self, keep_iterations: bool = True) -> None:
        self.requests: list[RequestRow] = []
        self.iterations: list[IterationRow] = []
        self.keep_iterations = keep_iterations
        self.cancelled_tokens = 0
        self._live: dict[int, RequestRow] = {}
        self._ending: list[RequestRow] = []
        """Finished in this iteration: its pass (emitted after Finished) may still set first_token."""

    def __call__(self, event: EngineEvent) -> None:
        if isinstance(event, PassDone):
            self._pass(event)
        elif isinstance(event, Arrived):
            self._live[event.request_id] = RequestRow(event.request_id, event.arrival, event.prompt_len)
        elif isinstance(event, Cancel):
            self.cancelled_tokens += event.end - event.start
            row = self._live.get(event.request_id)
            if row is not None:
                row.cancelled_tokens += event.end - event.start
        elif isinstance(event, LoadStarted) and event.is_async:
            self._scheduled(event.request_id, event.clock)
        elif isinstance(event, Finished):
            self._finished(event)

    def _scheduled(self, request_id: int, clock: float) -> None:
        row = self._live.get(request_id)
        if row is not None and row.first_scheduled is None:
            row.first_scheduled = clock

    def _pass(self, event: PassDone) -> None:
        end_clock = event.clock + event.seconds
        computed = 0
        for request_id, start, end in event.items:
            computed += end - start
            row = self._live.get(request_id) or self._ended(request_id)
            if row is None:
                continue
            if row.first_scheduled is None:
                row.first_scheduled = event.clock
            if row.first_token is None and end >= row.prompt_len:
                row.first_token = end_clock
        if self.keep_iterations:
            self.iterations.append(IterationRow(event.iteration, event.clock, event.seconds, len(event.items),
                                                computed, event.pages_in_use, event.hit_tokens))
        self.flush(end_clock)

    def flush(self, now: float | None = None) -> None:
        """Move the requests that finished into `requests` (at the end of their iteration)."""
        for row in self._ending:
            assert row.finished is not None, "a row ending has finished"
            row.finished = max(row.finished, now if now is not None else row.finished, row.first_token or 0.0)
            self.requests.append(row)
        self._ending = []

    def _finished(self, event: Finished) -> None:
        row = self._live.pop(event.request_id, None)
        if row is None:
            return
        row.local_hit_tokens = event.num_local_hit
        row.connector_hit_tokens = event.num_external
        row.computed_prompt_tokens = event.prompt_len - event.num_local_hit - event.num_external
        row.generated_tokens = event.num_generated_tokens
        row.finished = event.clock
        row.failure = None if event.failure is None else event.failure.value
        self._ending.append(row)

    def _ended(self, request_id: int) -> RequestRow | None:
        return next((r for r in self._ending if r.request_id == request_id), None)

    @property
    def unfinished(self) -> list[RequestRow]:
        return list(self._live.values())
