"""The engine's one seam to a connector's background work: when it runs (`held_work`, with the
gate for threads it cannot hold task by task: `async_gate`), on device pages the streams that
lose every race (`stream_races`), and the clock the runtime's waits on it are measured by
(`connector_clock`).

The engine tells it where the iteration is: a worker hook about to run (`before_hook`), around
every hook (`hook`), the pass's hooks done (`after_forward`), the reports of `get_finished` acted
on (`at_gate`), an iteration in which nothing could run (`idle`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from kvtool.engine import held_threads
from kvtool.engine.async_gate import AsyncGate
from kvtool.engine.connector_clock import ConnectorClock, quiet_process
from kvtool.engine.engine_config import EngineConfig
from kvtool.engine.events import WorkRan
from kvtool.engine.held_work import HeldWork
from kvtool.engine.hold_policy import HoldPoint, HoldPolicy
from kvtool.engine.hold_warden import HoldWarden
from kvtool.engine.stream_races import StreamRaces, stream_races_for


class ConnectorWork:
    def __init__(self, policy: HoldPolicy, emit: Callable[..., None], iteration: Callable[[], int],
                 races: StreamRaces | None = None) -> None:
        """`emit(kind, **fields)`: the engine's event stream (a `WorkRan` per released task);
        `iteration()`: the engine's current iteration; `races`: device pages' stream races (None
        on a CPU)."""
        self.races = races
        self.gate = AsyncGate(exempt=lambda thread: getattr(thread, held_threads.RELEASED, False),
                              untraced=held_threads.is_pool_worker)
        # Work started while the gate is shut (from a pass's first save hook on) is never drawn
        # before the gate: a save reported before its copy landed fails at every seed.
        self.held = HeldWork(policy, lambda r: emit(WorkRan, started_by=r.hook, started_at=r.started_iteration,
                                                    reason=r.reason), iteration,
                             lambda: HoldPoint.GATE if self.gate.is_closed else HoldPoint.AFTER_HOOK)
        self.clock = ConnectorClock()
        self._warden = HoldWarden(self.held)
        self._label = ""
        self._installed = False

    def install(self) -> None:
        """Hold what the connector starts from now on (the warden starts first: kvtool's own)."""
        self._warden.start()
        if self.races is not None:
            self.races.install()
        self.gate.install()
        held_threads.install(self.held)
        self._installed = True

    def uninstall(self) -> None:
        """The run is over: held work runs ("end"), nothing more is held or gated (idempotent)."""
        if self._installed:
            self._installed = False
            self.held.release_all("end")
            held_threads.uninstall(self.held)
            self._warden.stop()
        if self.races is not None:
            self.races.uninstall()
        self.gate.uninstall()

    def before_hook(self, hook: str) -> None:
        """A worker hook is about to run (the driver says which)."""
        self._label = hook
        self.gate.before_hook(hook)
        if self.races is not None:
            self.races.before_hook(hook)

    @contextmanager
    def hook(self) -> Iterator[None]:
        """Around every connector hook (the runtime's `around_hook`)."""
        label, self._label = self._label or "a scheduler-side hook", ""
        with self.gate.hook(), self.held.hook(label):
            self._warden.hook_entered()
            yield

    def after_forward(self) -> None:
        self.gate.close()

    def at_gate(self) -> None:
        """The reports of `get_finished` were acted on: the work due at the gate runs, then the
        threads the gate held."""
        self.held.at_point(HoldPoint.GATE)
        self.gate.open()

    def idle(self, wait_s: float) -> None:
        """Nothing could run this iteration: held work runs at once; with none, the clock waits
        (`ConnectorClock.wait`: mostly skipped while the connector is quiet: nothing of its own held
        or running, no thread of its own alive outside the pools, no thread of the process runnable)."""
        if self.held.release_all("idle"):
            self.clock.progress()
            return
        quiet = self.held.num_running == 0 and not self.gate.has_live_threads() and quiet_process()
        self.clock.wait(wait_s, quiet)


def connector_work_for(config: EngineConfig, has_connector: bool, emit: Callable[..., None],
                       iteration: Callable[[], int], device: torch.device, fake: object) -> ConnectorWork | None:
    """An engine's `ConnectorWork` where `config.gate_async_work` asks for it and a connector is
    attached (else None); with `config.stream_races` on device pages, its stream races (`fake`,
    the engine's bytes model, told to delay its writes behind them)."""
    if not (config.gate_async_work and has_connector):
        return None
    return ConnectorWork(config.hold_policy, emit, iteration, stream_races_for(config.stream_races, device, fake))
