"""A pass's copies in one direction, one layer at a time, and a connector's side stream.

`LayerBatches`: every request's pages of a layer in one prepared batch (`TransferBackend.
prepare_layers`: pages of all requests coalesced, built once per pass), launched once per layer on
the connector's `SideStream`: a save after that layer's compute, a load before it, and the forward
stream never made to wait for a copy it does not read. Without CUDA (pages in host memory) there is
no side stream: each launch has landed when it returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import torch

from kvtool.connector.api import HostStream
from kvtool.errors import LogicError
from kvtool.transfer.api import CopyOp, TransferBackend
from kvtool.transfer.torch_backend import TorchBackend


class SideStream:
    """A CUDA stream of the connector's own (None without CUDA pages): copies launched on it are
    ordered after the work the forward stream holds at `follow`, and the forward stream waits for
    them only where it is told to (`LayerBatches.wait`)."""

    def __init__(self, on_gpu: bool) -> None:
        self.stream: torch.cuda.Stream | None = torch.cuda.Stream() if on_gpu else None

    def follow(self, forward: torch.cuda.Stream | HostStream | None) -> None:
        """Order later copies after what `forward` (None: the current stream) holds now."""
        if self.stream is not None:   # pages on a GPU: the hooks were given a CUDA stream, not a HostStream
            self.stream.wait_stream(cast("torch.cuda.Stream | None", forward) or torch.cuda.current_stream())

    def launch(self, backend: TransferBackend, prepared: object) -> None:
        """`prepared` launched on the side stream (made current for the torch backend, which runs
        on the current stream; a CUDA backend orders its own streams against the one it is given)."""
        if self.stream is None:
            backend.launch(prepared, None)
        elif isinstance(backend, TorchBackend):
            with torch.cuda.stream(self.stream):
                backend.launch(prepared, self.stream)
        else:
            backend.launch(prepared, self.stream)

    def mark(self) -> torch.cuda.Event | None:
        """An event where the side stream is now (None without CUDA)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def drain(self, backend: TransferBackend) -> None:
        """Wait until every copy launched so far has landed (a save's bytes in the store too)."""
        backend.synchronize(self.stream)


@dataclass
class LayerBatches:
    """One direction of one pass: a prepared batch per layer, launched at most once each, in layer
    order. `landed[layer]`: where the side stream was after that layer's launch (loads)."""

    layer_ids: list[int]
    prepared: list[object]
    landed: dict[int, torch.cuda.Event | None] = field(default_factory=dict)
    launched: set[int] = field(default_factory=set)

    @staticmethod
    def prepare(backend: TransferBackend, layer_ids: Sequence[int], ops_by_layer: Sequence[Sequence[CopyOp]]
                ) -> LayerBatches:
        return LayerBatches(list(layer_ids), backend.prepare_layers(ops_by_layer))

    def launch(self, layer_id: int, backend: TransferBackend, side: SideStream, mark: bool = False) -> None:
        """Layer `layer_id`'s one batched launch (every request's pages), with an event behind it
        when `mark` (what `wait` waits for); LogicError when it has been launched already this pass
        or is no layer of the plan."""
        if layer_id in self.launched or layer_id not in self.layer_ids:
            raise LogicError(f"layer {layer_id} launched twice in a pass, or not a layer of the layout")
        side.launch(backend, self.prepared[self.layer_ids.index(layer_id)])
        self.launched.add(layer_id)
        if mark:
            self.landed[layer_id] = side.mark()

    def launch_all(self, backend: TransferBackend, side: SideStream) -> None:
        """Every layer in order, each marked (loads: the forward waits for its layer only)."""
        for layer_id in self.layer_ids:
            self.launch(layer_id, backend, side, mark=True)

    def wait(self, layer_id: int, forward: torch.cuda.Stream | HostStream | None) -> None:
        """`forward`'s later work after layer `layer_id`'s copies; returns once they have landed
        (so the hook that waits is timed until its bytes are there)."""
        event = self.landed.get(layer_id)
        if event is not None:
            (forward or torch.cuda.current_stream()).wait_event(event)
            event.synchronize()


class Landed:
    """A background batch on a CUDA stream, as the `Future` a block-store worker keeps: done once
    `event` (recorded behind the batch) has passed."""

    def __init__(self, event: torch.cuda.Event | None) -> None:
        self.event = event

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def result(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def exception(self) -> None:
        self.result()
        return None
