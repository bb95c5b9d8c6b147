"""What the CUDA backends share: their own stream, ordered against the caller's stream both ways,
and (`graphed`) prepared batches captured once as a CUDA graph and replayed with one driver call on
the caller's stream: no per-launch Python work, no cross-stream events."""

from __future__ import annotations

import sys
import threading
import warnings
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from kvtool.errors import LogicError
from kvtool.transfer import cuda_runtime as rt
from kvtool.transfer.api import CopyOp


class CudaBackendBase:
    name = "cuda"

    def __init__(self, priority: int | None = None, graphed: bool = False) -> None:
        self.stream, self.torch_stream = rt.new_stream(priority)
        self.graphed = graphed
        self._in_flight: deque[tuple[list[torch.cuda.Event], Any]] = deque()
        self._in_flight_lock = threading.Lock()     # an async connector launches from several threads

    def copy(self, ops: Sequence[CopyOp], stream: torch.cuda.Stream | None = None) -> None:
        """Enqueue on the backend's stream after the caller's work; the caller's later work waits.
        (Never graphed: a graph pays off only for a batch launched many times.)"""
        ops = [op for op in ops if op.src_slots]
        if ops:
            with rt.current():          # the batch's last reference may drop here: PyCUDA frees in context
                self.launch(self.prepare(ops, graphed=False), stream)

    def launch(self, prepared, stream: torch.cuda.Stream | None = None) -> None:
        """Enqueue prepared work: after the caller's stream, and before the caller's later work.
        A graphed batch runs on the caller's stream itself; the caller keeps `prepared` alive."""
        caller = stream or torch.cuda.current_stream()
        with rt.current():
            if isinstance(prepared, rt.Graph):
                self.join(caller)       # after copies earlier launches left running
                prepared.launch(caller.cuda_stream)
                self._keep(prepared, [caller])
                return
            self.torch_stream.wait_stream(caller)
            self.enqueue(prepared)
            self.keep_until_done(prepared)
        caller.wait_stream(self.torch_stream)

    def keep_until_done(self, objects: Any) -> None:
        """Hold `objects` (tensors the enqueued work reads) until every stream of the backend has
        passed this point: the caching allocator must not hand their memory out while a copy still
        reads it. (record_stream is not used: it would outlive the backend's streams.)"""
        self._keep(objects, self.streams())

    def _keep(self, objects: Any, streams: list[torch.cuda.Stream]) -> None:
        events = []
        for stream in streams:
            events.append(torch.cuda.Event())
            events[-1].record(stream)
        with self._in_flight_lock, rt.current():
            self._in_flight.append((events, objects))
            self._release_done()

    def _release_done(self) -> None:
        """Drop what the GPU has finished with (oldest first; the lock held, the context current:
        PyCUDA frees a dropped allocation only where its context is current, and otherwise warns
        `event in out-of-thread context could not be cleaned up` and leaks it)."""
        while self._in_flight and all(e.query() for e in self._in_flight[0][0]):
            self._in_flight.popleft()

    def streams(self) -> list[torch.cuda.Stream]:
        """Every stream the backend enqueues on."""
        return [self.torch_stream]

    def join(self, stream: torch.cuda.Stream | None = None) -> None:
        """Order `stream`'s later work after everything launched so far, including what a launch
        leaves running past its own ordering (a staged save's copies to the host)."""
        caller = stream or torch.cuda.current_stream()
        for own in self.streams():
            caller.wait_stream(own)

    def prepare(self, ops: Sequence[CopyOp], graphed: bool | None = None):
        """Host-side work before the launch (descriptor tables; with `graphed`, default the
        backend's setting, the batch captured as a CUDA graph); checks host memory is pinned."""
        for op in ops:
            _require_reachable(op)
        with rt.current():
            built = self.build(ops)
            if not (self.graphed if graphed is None else graphed):
                return built
            torch.cuda.synchronize()    # capture must not see work of other streams still pending
            return rt.capture(int(self.stream.handle), lambda: self._enqueue_joined(built), built)

    def prepare_layers(self, layers: Sequence[Sequence[CopyOp]]) -> list:
        """One prepared batch per layer (never graphed); `build_layers` may share work between them."""
        kept = [[op for op in ops if op.src_slots] for ops in layers]
        for op in (op for ops in kept for op in ops):
            _require_reachable(op)
        with rt.current():
            return self.build_layers(kept)

    def build_layers(self, layers: list[list[CopyOp]]) -> list:
        """`build` per layer; a backend that can derive one layer's batch from another's overrides it."""
        return [self.build(ops) for ops in layers]

    def _enqueue_joined(self, built) -> None:
        """`enqueue`, then the backend's own stream waits for its others: a capture must end with
        every stream it forked joined back (CUDA_ERROR_STREAM_CAPTURE_UNJOINED otherwise)."""
        self.enqueue(built)
        for own in self.streams()[1:]:
            self.torch_stream.wait_stream(own)

    def build(self, ops: Sequence[CopyOp]):
        return list(ops)

    def enqueue(self, prepared) -> None:
        raise NotImplementedError

    def __del__(self) -> None:
        """A backend dropped with copies in flight waits for them; then everything it owns (its
        streams and events, what the copies held, backends inside it) goes with the context
        current: the last reference may go on any thread (an asynchronous connector's worker),
        where PyCUDA would otherwise warn `... in out-of-thread context could not be cleaned up`
        and leak each object."""
        if sys.is_finalizing():
            return      # the context was popped at exit: pushing it again now would abort PyCUDA
        try:
            with rt.current():
                try:
                    # no loop variable may keep an entry alive past the `with`: a comprehension's do not
                    for event in [e for events, _ in getattr(self, "_in_flight", ()) for e in events]:
                        event.synchronize()
                finally:
                    self.__dict__.clear()
        except (RuntimeError, rt.cuda.Error) as exc:     # a copy failed earlier: say so, free the rest
            warnings.warn(f"a CUDA transfer backend was released after a failed copy: {exc}", stacklevel=2)

    def synchronize(self, stream: torch.cuda.Stream | None = None) -> None:
        for own in self.streams():
            own.synchronize()
        (stream or torch.cuda.current_stream()).synchronize()
        with self._in_flight_lock, rt.current():   # only what is done: another thread may have launched since
            self._release_done()


def _require_reachable(op: CopyOp) -> None:
    """Host memory must be pinned: the GPU reaches it through unified addressing."""
    for space in (op.src, op.dst):
        if space.device.type == "cpu" and not space.tensor.is_pinned():
            raise LogicError("CUDA transfer backends need pinned host memory (pin_memory=True)")


def is_host(op: CopyOp) -> bool:
    return op.src.device.type == "cpu" or op.dst.device.type == "cpu"
