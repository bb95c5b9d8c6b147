"""Connectors that copy on a CUDA stream of their own without ordering it against the stream the
hooks receive (the cross-stream class of vLLM #45704): right by accident on device pages until
`kvtool validate` makes the streams lose (`engine.stream_races`). On a CPU they are the host
connector (there is no stream to get wrong).

- `SideStreamSaves:SideStreamSavesWorker`: saves on its own stream without waiting for the hook's
  stream: it copies a layer's pages before the forward pass's writes land.
- `SideStreamLoads:SideStreamLoadsWorker`: loads on its own stream without making the hook's
  stream wait for the copy: the forward pass reads the pages before the copy lands.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtool.connectors.host import HostConnectorScheduler, HostConnectorWorker
from kvtool.connectors.metadata import PageTransfer


class _SideStream(HostConnectorWorker):
    """A CUDA stream of the worker's own, made with the worker (where there is a GPU)."""

    def __init__(self, llm_args) -> None:
        super().__init__(llm_args)
        self._side = torch.cuda.Stream() if torch.cuda.is_available() else None

    def side(self) -> torch.cuda.Stream:
        assert self._side is not None, "a side stream needs a GPU"
        return self._side


def _on_device(worker: HostConnectorWorker, transfers: Sequence[PageTransfer], to_store: bool,
               layer_id: int | None) -> None:
    """The host connector's copy, enqueued on the side stream (current while it is enqueued)."""
    slots = [t.location[1] for t in transfers]
    worker.backend.copy(worker.page_ops(transfers, worker.store, slots, to_store, layer_id))


class SideStreamSaves(HostConnectorScheduler):
    pass


class SideStreamSavesWorker(_SideStream):
    """The defect: a save's copy on its own stream, never ordered after the stream of the hook."""

    def save(self, transfers: Sequence[PageTransfer], layer_id: int | None = None) -> None:
        if not torch.cuda.is_available():
            return super().save(transfers, layer_id)
        side = self.side()
        with torch.cuda.stream(side):
            _on_device(self, transfers, True, layer_id)
        side.synchronize()            # landed on return, as the contract asks: but read too early


class SideStreamLoads(HostConnectorScheduler):
    pass


class SideStreamLoadsWorker(_SideStream):
    """The defect: a load's copy on its own stream, and the hook's stream never made to wait for it."""

    def load(self, transfers: Sequence[PageTransfer], layer_id: int | None = None) -> None:
        if not torch.cuda.is_available():
            return super().load(transfers, layer_id)
        with torch.cuda.stream(self.side()):
            _on_device(self, transfers, False, layer_id)
