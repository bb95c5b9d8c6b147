"""Every worker hook kvtool calls on a vLLM connector, in order, and the one guard around them.

A hook that raises stops the run, as it stops vLLM's engine core: `HookFailed` names the hook, the
worker and where in the connector's code it raised.
"""

from __future__ import annotations

import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvtool.connector.raised import describe_error, format_error, stops_kvtool
from kvtool.errors import ConnectorError


class HookFailed(ConnectorError):
    """A connector hook raised (scheduler side inside vLLM's scheduler, or a worker hook)."""

    def __init__(self, hook: str, worker: int | None, exc: BaseException) -> None:
        where = "scheduler" if worker is None else f"worker {worker}"
        super().__init__(f"{hook} ({where}) raised {describe_error(exc)}")
        self.hook = hook
        self.traceback = format_error(exc)


@dataclass(frozen=True)
class HookCall:
    step: int
    worker: int
    hook: str


@dataclass(frozen=True)
class HookSpan:
    """One hook call's wall-clock interval (`time.perf_counter` seconds)."""

    step: int
    worker: int
    hook: str
    start: float
    end: float


@dataclass
class HookLog:
    """The worker hooks called so far, and when; `step` is set by the driver before each step."""

    step: int = 0
    calls: list[HookCall] = field(default_factory=list)
    spans: list[HookSpan] = field(default_factory=list)
    """Every call's interval, a raising one included."""

    def call(self, worker: int, connector: Any, hook: str, *args: Any) -> Any:
        """`connector.hook(*args)`, recorded and timed; HookFailed when it raises."""
        self.calls.append(HookCall(self.step, worker, hook))
        start = time.perf_counter()
        try:
            return getattr(connector, hook)(*args)
        except BaseException as exc:  # noqa: BLE001 - a connector's failure is the finding
            if stops_kvtool(exc):
                raise
            raise HookFailed(hook, worker, exc) from exc
        finally:
            self.spans.append(HookSpan(self.step, worker, hook, start, time.perf_counter()))

    def counts(self, worker: int = 0) -> Counter[str]:
        return Counter(c.hook for c in self.calls if c.worker == worker)

    def order(self, step: int, worker: int = 0) -> list[str]:
        """The hooks of one step of one worker, in call order."""
        return [c.hook for c in self.calls if c.step == step and c.worker == worker]


def traceback_of(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))
