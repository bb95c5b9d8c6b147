"""Requests that wait on the connector too long fail: an asynchronous load in transmission past
`max_transmission_iterations` (or `max_transmission_seconds`), an asynchronous save unreported
past `max_saving_seconds`."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvtool.engine.engine_config import EngineConfig
from kvtool.engine.request_queues import RequestQueues
from kvtool.engine.request_state import FailureReason, Phase, RequestState


class Watchdogs:
    def __init__(self, config: EngineConfig, fail: Callable[[RequestState, FailureReason, str], None],
                 now: Callable[[], float] = time.monotonic) -> None:
        """`now`: the clock the waits are measured by (`connector_clock`: skips what a quiet
        connector would only be waited on for)."""
        self._config = config
        self._now = now
        self._loading_since: dict[int, float] = {}
        self._fail = fail
        self._saving_since: dict[int, float] = {}
        """Request id -> when this check first saw it saving."""

    def check(self, queues: RequestQueues, iteration: int) -> None:
        """Fail the stuck ones among the started requests (at the end of each iteration)."""
        seconds, limit = self._config.max_transmission_seconds, self._config.max_transmission_iterations
        now = self._now()
        loading = queues.started_in(Phase.TRANSMISSION)
        since = _since(self._loading_since, loading, now)
        for state in loading:
            if seconds is not None and now - since[state.request_id] > seconds:
                self._fail(state, FailureReason.STUCK_IN_TRANSMISSION, f"for more than {seconds:g} s")
            elif seconds is None and iteration - state.transmission_since > limit:
                self._fail(state, FailureReason.STUCK_IN_TRANSMISSION, f"for more than {limit} iterations")
        self._fail_stuck_saves(queues.started_in(Phase.SAVING), now)

    def waits_for(self, loads: list[tuple[int, float]], iteration: int) -> bool:
        """Whether any of `loads` (each the iteration and `time.monotonic()` it was confirmed) is
        still within the transmission bound: a prefix load the runtime waits for before the run ends
        (one past it keeps its reservation, as TensorRT-LLM keeps a transfer that never completes)."""
        seconds, limit = self._config.max_transmission_seconds, self._config.max_transmission_iterations
        now = time.monotonic()
        return any(now - at <= seconds if seconds is not None else iteration - since <= limit for since, at in loads)

    def _fail_stuck_saves(self, saving: list[RequestState], now: float) -> None:
        """A request whose asynchronous save is unreported `max_saving_seconds` after the end of
        the iteration that finished it (when this check first saw it saving)."""
        seconds = self._config.max_saving_seconds
        if seconds is None:
            return
        since = _since(self._saving_since, saving, now)
        for state in saving:
            if now - since[state.request_id] > seconds:
                self._fail(state, FailureReason.STUCK_IN_TRANSMISSION, f"request {state.request_id} waits for its "
                           f"asynchronous save, which get_finished never reported within {seconds:g} s")


def _since(since: dict[int, float], states: list[RequestState], now: float) -> dict[int, float]:
    """`since` (request id -> when a check first saw it waiting) kept to `states`, `now` for new ones."""
    for request_id in set(since) - {s.request_id for s in states}:
        del since[request_id]
    for state in states:
        since.setdefault(state.request_id, now)
    return since


def stuck_description(live: list[RequestState]) -> str:
    """What the first three unfinished requests wait for, in the connector's terms."""
    waits = {Phase.TRANSMISSION: "its asynchronous load, which get_finished never reported",
             Phase.SAVING: "its asynchronous save, which get_finished never reported",
             Phase.WAITING: "pages (deferred)", Phase.CONTEXT: "prefill", Phase.GENERATION: "generation"}
    return "; ".join(f"request {s.request_id} waits for {waits.get(s.phase, s.phase.value)}" for s in live[:3])
