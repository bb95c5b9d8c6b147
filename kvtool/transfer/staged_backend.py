"""`staged`: a GPU gather into a contiguous staging buffer, then copy-engine copies on their own
stream (and the reverse for loads), pipelined in chunks. Measured in results/h200-link-study.

Why copy engines: two SM kernels streaming over PCIe in opposite directions fight over the link;
copy engines in opposite directions do not. Why chunks: with one gather of the whole batch before
one copy, the link idles while the gather runs; chunks growing from `first_chunk_bytes` start the
copy engine after a small first gather. Why the whole GPU for the gather by default: beside a
matrix product a gather gets SMs only between the product's kernels (a few-SM gather, even with
SMs left free by cuBLAS's carve-out, was starved: 0.35-0.48 of the link), and the whole GPU
gathers a 64 MiB batch in about 35 µs. The host side is copied in runs of consecutive slots (one
copy per run), so it is fast when a connector gives a batch consecutive store slots.

Why no gather for large pages: where the pages of a host batch come in runs consecutive on both
sides of at least `direct_run_bytes` on average (a 2 MiB page of every layer is one such run by
itself), the copy engine carries each run straight between the pages and the host: a gather would
only copy every byte once more and cost a descriptor table per batch. Where the driver has
cuMemcpyBatchAsync (its CUDA 13 form, `_v2`), the batch's plain runs go to the copy engine in that one call: one
cuMemcpyAsync per run costs several µs of launch each, and in results/protocol-store-bench 128
runs of 2 MiB took 0.9 ms to launch while the link carried them in 4.9 ms.

A save's launch orders the caller's later work after the gathers only: the pages may be written
again from then on, while the copy engine still carries the staged bytes to the host; `join` or
`synchronize` waits for those. That is what lets a prepared save launched again and again keep the
link busy beside a matrix product (`ring` staging buffers, used in turn): the batches after the
one on the link are gathered at the product's next kernel boundary.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvtool.errors import LogicError
from kvtool.transfer import cuda_runtime as rt
from kvtool.transfer.api import CopyOp, PageSpace, layer_shifts
from kvtool.transfer.cuda_base import CudaBackendBase
from kvtool.transfer.descriptors import (
    PitchedCopy,
    RunBatch,
    direct_copies,
    pipeline_chunks,
    run_batch,
    shifted_copy,
    slot_runs,
)
from kvtool.transfer.kernel_backend import KernelBackend

DEFAULT_CHUNK_BYTES = 32 << 20
DEFAULT_FIRST_CHUNK_BYTES = 4 << 20
"""Chunks of a gathered batch: 4 MiB first, growing to 32 MiB. One H100, 64 MiB batches of 16 KB
pages (results/issue-56-link, same run): 0.977 of the link saving and 0.978 loading, against
0.964 / 0.966 with 1 MiB growing to 8 MiB (16 MiB: 0.971 / 0.970)."""
DEFAULT_GATHER_SMS = None
DEFAULT_DIRECT_RUN_BYTES = 512 << 10
"""Mean bytes per run from which a host batch goes straight through the copy engine (results/
protocol-store-bench: a copy-engine call costs a few µs, which 512 KiB take about 10 µs to cross)."""
GATHER_BLOCKS_PER_SM = 2
DEFAULT_BATCH_RUNS = True
"""Whether a direct plan's plain runs go in one cuMemcpyBatchAsync (where the driver has it)."""


class _PlanKind(enum.Enum):
    DEVICE = "device"     # GPU to GPU: the kernel alone
    SAVE = "save"         # kernel gathers a chunk into staging, a copy engine moves it to the host
    LOAD = "load"         # a copy engine moves a chunk into staging, the kernel scatters it
    DIRECT = "direct"     # a copy engine moves each run of pages between the pages and the host


def _event():
    return rt.cuda.Event(rt.cuda.event_flags.DISABLE_TIMING)


@dataclass
class _Chunk:
    kernel: list                                  # the prepared gather / scatter launch
    runs: list[PitchedCopy]
    """The copy-engine calls between staging and the host, one per run of consecutive host slots."""
    ready: Any = field(default_factory=_event)   # a PyCUDA event


@dataclass
class _Slot:
    """One staging buffer of a plan and the launches that go through it."""

    chunks: list[_Chunk]
    staging: PageSpace | None = None
    free: Any = field(default_factory=_event)
    """Recorded where the last use of `staging` ends; the next use waits for it."""


@dataclass
class _Plan:
    kind: _PlanKind
    slots: list[_Slot]
    turn: int = 0
    runs: list[PitchedCopy] = field(default_factory=list)
    """A DIRECT plan's copies."""
    batch: RunBatch | None = None
    """A DIRECT plan's copies grouped for one batched driver call (None: one call per run)."""
    after_sibling: bool = False
    """A LOAD plan of a layer after the first (`build_layers`), launched right after the layer
    before: its host copies need not wait for the backend's stream (the scatters of the layers
    before), since its staging part is its own and the first layer's copies waited for the rest."""

    def next_slot(self) -> _Slot:
        slot = self.slots[self.turn % len(self.slots)]
        self.turn += 1
        return slot


class StagedBackend(CudaBackendBase):
    name = "staged"

    def __init__(self, priority: int | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 gather_sms: int | None = DEFAULT_GATHER_SMS, graphed: bool = False,
                 first_chunk_bytes: int = DEFAULT_FIRST_CHUNK_BYTES, ring: int = 1,
                 direct_run_bytes: int | None = None, batch_runs: bool | None = None) -> None:
        """Chunks grow from `first_chunk_bytes` to `chunk_bytes` (0: one chunk per batch, no
        pipelining); `gather_sms` None: the gather uses the whole GPU; `ring`: staging buffers
        per prepared plan, used in turn (a graph replays one, so graphed needs ring 1);
        `direct_run_bytes` (None: DEFAULT_DIRECT_RUN_BYTES, read when constructed; 0: always
        gather): the mean run size from which a host batch skips staging; `batch_runs` (None:
        DEFAULT_BATCH_RUNS, read when constructed): a direct batch's plain runs in one
        cuMemcpyBatchAsync where the driver has it (not inside a graph's capture)."""
        if graphed and ring != 1:
            raise LogicError("a graphed staged plan replays one staging buffer: ring must be 1")
        super().__init__(priority, graphed)
        self.ring = ring
        self.direct_run_bytes = DEFAULT_DIRECT_RUN_BYTES if direct_run_bytes is None else direct_run_bytes
        wanted = DEFAULT_BATCH_RUNS if batch_runs is None else batch_runs
        self.batch_runs = bool(wanted and rt.has_memcpy_batch())
        self.chunk_bytes = chunk_bytes
        self.first_chunk_bytes = first_chunk_bytes
        self.gather_sms = gather_sms
        blocks = None if gather_sms is None else gather_sms * GATHER_BLOCKS_PER_SM
        self._gather = KernelBackend(device_max_blocks=blocks)     # its copies are all GPU to GPU
        # a plain GPU-to-GPU copy is not rate-limited by a link: the whole GPU
        self._device = self._gather if blocks is None else KernelBackend()
        self._copy_stream, self._copy_torch_stream = rt.new_stream(priority)

    def build(self, ops: Sequence[CopyOp]) -> list[_Plan]:
        return [self._plan(op) for op in ops]

    def build_layers(self, layers: list[list[CopyOp]]) -> list[list[_Plan]]:
        """Where every layer is the first at other offsets (`layer_shifts`, multiples of 16 bytes),
        each op's plan is built once: tables, runs and the host-slot order found once, the other
        layers' moved by their shifts, every layer's staging a part of one buffer."""
        shifts = layer_shifts(layers)
        if shifts is None or any(s % 16 or d % 16 for per_layer in shifts for s, d in per_layer):
            return super().build_layers(layers)
        per_op = [self._shifted_plans(op, [per_layer[j] for per_layer in shifts]) for j, op in enumerate(layers[0])]
        for plans in per_op:
            for plan in plans[1:]:
                plan.after_sibling = True
        return [[plans[i] for plans in per_op] for i in range(len(layers))]

    def _plan(self, op: CopyOp) -> _Plan:
        plan = self._shifted_plans(op, [(0, 0)])[0]
        if plan.kind in (_PlanKind.SAVE, _PlanKind.LOAD):      # `ring` staging buffers, used in turn
            plan.slots += [self._shifted_slots(op, plan.kind is _PlanKind.SAVE, [(0, 0)])[0]
                           for _ in range(self.ring - 1)]
        return plan

    @staticmethod
    def _sides(op: CopyOp) -> tuple[bool, bool]:
        src_host, dst_host = op.src.device.type == "cpu", op.dst.device.type == "cpu"
        if src_host and dst_host:
            raise LogicError("the staged backend moves data to or from the GPU")
        return src_host, dst_host

    def _shifted_plans(self, op: CopyOp, shifts: list[tuple[int, int]]) -> list[_Plan]:
        """`op`'s plan at each (src, dst) byte shift, one staging buffer each."""
        src_host, dst_host = self._sides(op)
        if not src_host and not dst_host:
            return [_Plan(_PlanKind.DEVICE, [_Slot([_Chunk(kernel, [])])])
                    for kernel in self._device.build_shifted([op], shifts)]
        direct = direct_copies(op, self.direct_run_bytes)
        if direct is not None:
            moved = [[shifted_copy(c, s, d) for c in direct] for s, d in shifts]
            return [_Plan(_PlanKind.DIRECT, [], runs=runs, batch=run_batch(runs) if self.batch_runs else None)
                    for runs in moved]
        kind = _PlanKind.SAVE if dst_host else _PlanKind.LOAD
        return [_Plan(kind, [slot]) for slot in self._shifted_slots(op, dst_host, shifts)]

    def _shifted_slots(self, op: CopyOp, dst_host: bool, shifts: list[tuple[int, int]]) -> list[_Slot]:
        """Per shift, a staging buffer for `op` (parts of one allocation), and per chunk its gather
        (or scatter) and host runs, found once and moved by the shift."""
        host_slots = np.asarray(op.dst_slots if dst_host else op.src_slots)
        gpu_slots = np.asarray(op.src_slots if dst_host else op.dst_slots)
        order = np.argsort(host_slots, kind="stable")
        part = -(-len(order) * op.nbytes // 256) * 256
        buffer = torch.empty(len(shifts) * part, dtype=torch.uint8, device="cuda")
        stagings = [PageSpace(buffer, op.nbytes, op.nbytes, len(order), i * part) for i in range(len(shifts))]
        # (gpu, staging) shifts of the kernel's copies, (src, dst) shifts of the host runs
        if dst_host:
            kernel_shifts = [(s, i * part) for i, (s, _) in enumerate(shifts)]
            run_shifts = [(i * part, d) for i, (_, d) in enumerate(shifts)]
        else:
            kernel_shifts = [(i * part, d) for i, (_, d) in enumerate(shifts)]
            run_shifts = [(s, i * part) for i, (s, _) in enumerate(shifts)]
        host, host_offset = (op.dst, op.dst_offset) if dst_host else (op.src, op.src_offset)
        staging = stagings[0]
        chunks: list[list[_Chunk]] = [[] for _ in shifts]
        # a layer-by-layer pass pipelines its layers (one on the link while the next is gathered):
        # each layer in one chunk (results/issue-56-link: 0.92-0.94 of the link against 0.88-0.92
        # in growing chunks, shuffled pages, and a third of the host time)
        max_chunk = 0 if len(shifts) > 1 else self.chunk_bytes
        for first, count in pipeline_chunks(len(order), op.nbytes, self.first_chunk_bytes, max_chunk):
            rows = tuple(range(first, first + count))
            chunk_order = order[first:first + count]
            runs = [_host_run(host.address(int(host_slots[chunk_order[start]]), host_offset), host.stride,
                              staging.address(first + start), op.nbytes, length, dst_host)
                    for start, length in slot_runs(host_slots[chunk_order])]
            gpu = tuple(gpu_slots[chunk_order].tolist())
            kernel_op = (CopyOp(op.src, staging, gpu, rows, op.nbytes, op.src_offset, 0) if dst_host else
                         CopyOp(staging, op.dst, rows, gpu, op.nbytes, 0, op.dst_offset))
            kernels = self._gather.build_shifted([kernel_op], kernel_shifts)
            for i, (s, d) in enumerate(run_shifts):
                chunks[i].append(_Chunk(kernels[i], [shifted_copy(r, s, d) for r in runs]))
        return [_Slot(chunks[i], stagings[i]) for i in range(len(shifts))]

    def enqueue(self, prepared: list[_Plan], batched: bool = True) -> None:
        """`batched` False: a direct plan's runs one call each (inside a graph's capture)."""
        for plan in prepared:
            if plan.kind is _PlanKind.DEVICE:
                self._device.enqueue(plan.slots[0].chunks[0].kernel, self.stream)
            elif plan.kind is _PlanKind.DIRECT:
                _copy_direct(plan, int(self.stream.handle), batched)
            elif plan.kind is _PlanKind.SAVE:
                self._save(plan.next_slot())
            else:
                self._load(plan.next_slot(), plan.after_sibling)

    def _save(self, slot: _Slot) -> None:
        """Gather chunk i on the backend's stream once the slot's last copies are done; the copy
        stream moves it once it is gathered. The backend's stream does not wait for the copies."""
        self.stream.wait_for_event(slot.free)
        for chunk in slot.chunks:
            self._gather.enqueue(chunk.kernel, self.stream)
            chunk.ready.record(self.stream)
            self._copy_stream.wait_for_event(chunk.ready)
            _copy_runs(chunk.runs, int(self._copy_stream.handle))
        slot.free.record(self._copy_stream)

    def _load(self, slot: _Slot, after_sibling: bool = False) -> None:
        """Copy chunk i into staging on the copy stream once earlier work is done (the slot's last
        scatter included; for a layer after the first, `_Plan.after_sibling`, only what the copy
        stream already holds); the backend's stream scatters it once landed."""
        if not after_sibling:
            slot.free.record(self.stream)
            self._copy_stream.wait_for_event(slot.free)
        for chunk in slot.chunks:
            _copy_runs(chunk.runs, int(self._copy_stream.handle))
            chunk.ready.record(self._copy_stream)
            self.stream.wait_for_event(chunk.ready)
            self._gather.enqueue(chunk.kernel, self.stream)

    def streams(self) -> list[torch.cuda.Stream]:
        return [self.torch_stream, self._copy_torch_stream]

    def _enqueue_joined(self, built: list[_Plan]) -> None:
        """What a graph captures: direct runs one call each (a batched copy is not known to be
        capturable on every driver), and the copy stream joined only where a plan forked it in (a
        staged save or load): waiting on it otherwise orders the graph after work outside the
        capture, which the driver refuses (`dependency created on uncaptured work in another stream`)."""
        self.enqueue(built, batched=False)
        if any(plan.kind in (_PlanKind.SAVE, _PlanKind.LOAD) for plan in built):
            self.torch_stream.wait_stream(self._copy_torch_stream)


def _host_run(host: int, host_pitch: int, staging: int, row_bytes: int, rows: int, to_host: bool) -> PitchedCopy:
    """The copy of `rows` rows between the host (rows `host_pitch` apart) and staging (back to back)."""
    if to_host:
        return PitchedCopy(host, host_pitch, staging, row_bytes, row_bytes, rows)
    return PitchedCopy(staging, row_bytes, host, host_pitch, row_bytes, rows)


def _copy_direct(plan: _Plan, stream_handle: int, batched: bool) -> None:
    """A direct plan's copies: its plain runs in one batched call where it has a batch and
    `batched`, else one call per run."""
    if plan.batch is None or not batched:
        _copy_runs(plan.runs, stream_handle)
        return
    if len(plan.batch.sizes):
        rt.memcpy_batch_async(plan.batch.dsts, plan.batch.srcs, plan.batch.sizes, stream_handle)
    _copy_runs(plan.batch.strided, stream_handle)


def _copy_runs(runs: Sequence[PitchedCopy], stream_handle: int) -> None:
    """One copy-engine call per run on the given stream: a plain copy where the rows are back to
    back on both sides (or one row), a strided 2D copy otherwise."""
    for run in runs:
        if run.is_flat:
            rt.memcpy_async(run.dst, run.src, run.width * run.rows, stream_handle)
        else:
            rt.memcpy_2d_async(run.dst, run.dst_pitch, run.src, run.src_pitch, run.width, run.rows, stream_handle)
