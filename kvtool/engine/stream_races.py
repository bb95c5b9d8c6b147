"""Streams that lose every race they can (device pages, `kvtool validate`): the runtime's side of
the cross-stream races between a connector's copies and the forward pass, made certain.

On a GPU the fake engine's writes and reads are tiny and land long before the host reaches the
next hook, so a copy on a stream of the connector's own that is not ordered against the stream its
hooks receive is right by accident. While installed:

- each layer's writes wait on the forward stream behind a device-side spin of WRITE_SPIN_S (the
  fake engine reads what the layer attends to first: `FakeEngine.delay_writes`), so a save that
  does not wait for the stream `save_kv_layer` / `wait_for_save` received copies the bytes from
  before the layer wrote them;
- every CUDA stream the connector creates (`torch.cuda.Stream()`, while installed) gets a spin
  enqueued when a load hook is entered (CONNECTOR_SPINS_S: `start_load_kv`, `wait_for_layer_load`),
  before the connector enqueues anything there, and the fake engine reads a layer's loaded pages as
  soon as `wait_for_layer_load` returned: a load the forward stream was not made to wait for (an
  event recorded after the copy, `stream.wait_event`) lands after the pass that needed it. The
  spins are longer than the host's way from the hook to the read (Python calls: tens to hundreds
  of microseconds).

A correct connector pays the spins in stream order (the forward stream waits for them). Streams
made outside `torch.cuda.Stream` (PyCUDA's, `ExternalStream`) are not spun: a load on one is only
ordered by its own luck. Spins are in device clock cycles at SPIN_CLOCK_HZ (a slower clock spins
longer, never shorter).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping

import torch

from kvtool.engine.fake_engine import FakeEngine

WRITE_SPIN_S = 0.001
"""Device seconds each layer's writes wait behind on the forward stream: longer than the host's way
from the writes to a save hook's copy (the hook's Python calls, the connector building its copy:
a few hundred microseconds), and mostly overlapped by the host's own work until the next layer."""
CONNECTOR_SPINS_S = {"start_load_kv": 0.003, "wait_for_layer_load": 0.001}
"""Device seconds a connector's own stream is held at each load hook's entry (the way from
`start_load_kv` to the first layer's read is longer than from `wait_for_layer_load`)."""
SPIN_CLOCK_HZ = 2.0e9
"""The clock the spins' cycles are counted at (an H100's or H200's boost clock, about 1.98 GHz)."""

_ORIGINAL_NEW = torch.cuda.Stream.__new__
_CREATED: weakref.WeakSet[torch.cuda.Stream] = weakref.WeakSet()
"""Streams made through `torch.cuda.Stream()` while a `StreamRaces` was installed."""
_NUM_INSTALLED = [0]


def _noting_new(cls, *args, **kwargs):
    """`torch.cuda.Stream.__new__`, noting a new stream in `_CREATED` (not one that wraps an
    existing stream: by its id, `torch.cuda.current_stream()`'s, the forward stream; by its
    pointer, an `ExternalStream`)."""
    stream = _ORIGINAL_NEW(cls, *args, **kwargs)
    if "stream_id" not in kwargs and "stream_ptr" not in kwargs:
        _CREATED.add(stream)
    return stream


def spin(seconds: float, stream: torch.cuda.Stream | None = None) -> None:
    """Enqueue a device-side spin of about `seconds` on `stream` (default: the current one)."""
    cycles = int(seconds * SPIN_CLOCK_HZ)
    if stream is None:
        torch.cuda._sleep(cycles)
        return
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)


class StreamRaces:
    """Installed on one engine whose pages are on a GPU (`install` / `uninstall`, idempotent)."""

    def __init__(self, write_spin_s: float = WRITE_SPIN_S, connector_spins_s: Mapping[str, float] = CONNECTOR_SPINS_S,
                 spin_on: Callable[[float, torch.cuda.Stream | None], None] = spin) -> None:
        """`connector_spins_s`: hook -> seconds its entry spins each connector stream;
        `spin_on(seconds, stream)`: how a spin is enqueued (a test counts them)."""
        self._write_spin_s = write_spin_s
        self._connector_spins_s = dict(connector_spins_s)
        self._spin = spin_on
        self._installed = False

    def install(self) -> None:
        """Note every stream the connector creates from now on."""
        if not self._installed:
            self._installed = True
            _NUM_INSTALLED[0] += 1
            torch.cuda.Stream.__new__ = staticmethod(_noting_new)   # type: ignore[method-assign,assignment]

    def uninstall(self) -> None:
        if self._installed:
            self._installed = False
            _NUM_INSTALLED[0] -= 1
            if not _NUM_INSTALLED[0]:
                torch.cuda.Stream.__new__ = staticmethod(_ORIGINAL_NEW)   # type: ignore[method-assign,assignment]

    def before_hook(self, hook: str) -> None:
        """A worker hook is about to run: a load hook spins the connector's streams first."""
        seconds = self._connector_spins_s.get(hook)
        if self._installed and seconds:
            for stream in list(_CREATED):
                self._spin(seconds, stream)

    def before_writes(self) -> None:
        """The fake engine is about to enqueue a layer's writes on the forward stream."""
        self._spin(self._write_spin_s, None)


def stream_races_for(enabled: bool, device: torch.device, fake: object) -> StreamRaces | None:
    """An engine's races (`enabled`: validate's runs with a connector), on device pages only; the
    fake engine `fake` told to delay its writes behind them (a fingerprinting one: `FakeEngine`)."""
    if not enabled or device.type != "cuda" or not isinstance(fake, FakeEngine):
        return None
    races = StreamRaces()
    fake.delay_writes = races.before_writes
    return races
