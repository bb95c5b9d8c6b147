"""The runtime's gate on a connector's threads (`kvtool.engine.async_gate`): closed, a gated
thread stops at its next call; opened, the runtime waits until the work it let through has run,
also where that work sits in one long C call or waits for a core."""

from __future__ import annotations

import threading
import time

import pytest

from kvtool.engine import async_gate
from kvtool.engine.async_gate import AsyncGate

LIMIT_S = 5.0
"""The drain's limit in these tests: far above what the work takes even on a loaded machine, so
that returning early (the bug) and hitting the limit are told apart from waiting for the work."""


@pytest.fixture(autouse=True)
def long_drain_limit(monkeypatch):
    monkeypatch.setattr(async_gate, "DRAIN_LIMIT_S", LIMIT_S)


def _busy_in_c(seconds: float) -> None:
    """Hold a core for about `seconds` inside C calls only (no Python call the gate could see)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sum(range(20_000))


def _copy_thread(gate_went_shut: threading.Event, landed: list[str]) -> threading.Thread:
    def copy() -> None:
        gate_went_shut.wait()
        _step()                  # a Python call: held here while the gate is shut
        _busy_in_c(0.05)
        landed.append("copy")

    def _step() -> None:
        pass

    return threading.Thread(target=copy, daemon=True)


def test_a_gated_thread_stops_while_shut_and_open_waits_until_its_work_has_run():
    gate, landed, shut = AsyncGate(), [], threading.Event()
    gate.install()
    try:
        thread = _copy_thread(shut, landed)
        thread.start()
        gate.close()
        shut.set()
        time.sleep(0.1)
        assert landed == []          # held at its call while the gate was shut
        started = time.monotonic()
        gate.open()
        assert landed == ["copy"]    # open returned only once the copy's 50 ms in C had run
        assert time.monotonic() - started < LIMIT_S   # and not by running out its limit
    finally:
        gate.uninstall()
    thread.join(1)


def test_open_returns_at_once_when_no_gated_thread_has_work():
    gate = AsyncGate()
    gate.install()
    try:
        idle = threading.Thread(target=threading.Event().wait, args=(2,), daemon=True)
        idle.start()
        time.sleep(0.02)
        started = time.monotonic()
        gate.open()
        assert time.monotonic() - started < LIMIT_S / 2
    finally:
        gate.uninstall()
