"""`staged`: a GPU gather into a contiguous staging buffer, then copy-engine copies on their own
stream (and the reverse for loads). Two SM kernels streaming over PCIe in opposite directions fight
over the link; copy engines in opposite directions do not, so this keeps both directions fast when
saves and loads overlap. The host side is copied in runs of consecutive slots (one strided 2D copy
per run), so it is fast when a connector gives a batch consecutive store slots.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from kvtool.errors import LogicError
from kvtool.transfer import cuda_runtime as rt
from kvtool.transfer.api import CopyOp, PageSpace
from kvtool.transfer.cuda_base import CudaBackendBase
from kvtool.transfer.descriptors import slot_runs
from kvtool.transfer.kernel_backend import KernelBackend


class _PlanKind(enum.Enum):
    DEVICE = "device"     # GPU to GPU: the kernel alone
    SAVE = "save"         # kernel gathers into staging, then copy-engine runs to the host
    LOAD = "load"         # copy-engine runs from the host into staging, then the kernel scatters


@dataclass
class _Plan:
    kind: _PlanKind
    kernel: list                    # the prepared gather / scatter launch
    staging: PageSpace | None = None
    runs: list[tuple[int, int, int, int]] | None = None
    """(host address, host pitch, staging address, rows) of each run of consecutive host slots."""
    row_bytes: int = 0


class StagedBackend(CudaBackendBase):
    name = "staged"

    def __init__(self, priority: int | None = None) -> None:
        super().__init__(priority)
        self._gather = KernelBackend(max_sms=rt.num_sms())
        self._copy_stream, self._copy_torch_stream = rt.new_stream(priority)

    def build(self, ops: Sequence[CopyOp]) -> list[_Plan]:
        return [self._plan(op) for op in ops]

    def _plan(self, op: CopyOp) -> _Plan:
        src_host, dst_host = op.src.device.type == "cpu", op.dst.device.type == "cpu"
        if src_host and dst_host:
            raise LogicError("the staged backend moves data to or from the GPU")
        if not src_host and not dst_host:
            return _Plan(_PlanKind.DEVICE, self._gather.build([op]))
        host_slots = np.asarray(op.dst_slots if dst_host else op.src_slots)
        order = np.argsort(host_slots, kind="stable")
        staging = PageSpace.contiguous(torch.empty(len(order) * op.nbytes, dtype=torch.uint8, device="cuda"),
                                       op.nbytes)
        rows = tuple(range(len(order)))
        host, host_offset = (op.dst, op.dst_offset) if dst_host else (op.src, op.src_offset)
        runs = [(host.address(int(host_slots[order[start]]), host_offset), host.stride, staging.address(start), length)
                for start, length in slot_runs(host_slots[order])]
        if dst_host:
            gather = CopyOp(op.src, staging, tuple(np.asarray(op.src_slots)[order].tolist()), rows, op.nbytes,
                            op.src_offset, 0)
            return _Plan(_PlanKind.SAVE, self._gather.build([gather]), staging, runs, op.nbytes)
        scatter = CopyOp(staging, op.dst, rows, tuple(np.asarray(op.dst_slots)[order].tolist()), op.nbytes,
                         0, op.dst_offset)
        return _Plan(_PlanKind.LOAD, self._gather.build([scatter]), staging, runs, op.nbytes)

    def enqueue(self, prepared: list[_Plan]) -> None:
        for plan in prepared:
            if plan.kind is _PlanKind.LOAD:
                self._host_copies(plan, to_host=False)
            self._gather.launch(plan.kernel, self.torch_stream)
            if plan.kind is _PlanKind.SAVE:
                self._host_copies(plan, to_host=True)

    def _host_copies(self, plan: _Plan, to_host: bool) -> None:
        """Copy-engine copies of every run, on the copy stream, between two waits."""
        self._copy_torch_stream.wait_stream(self.torch_stream)
        handle = int(self._copy_stream.handle)
        for host, pitch, staging, rows in plan.runs:
            if to_host:
                rt.memcpy_2d_async(host, pitch, staging, plan.row_bytes, plan.row_bytes, rows, handle)
            else:
                rt.memcpy_2d_async(staging, plan.row_bytes, host, pitch, plan.row_bytes, rows, handle)
        self.torch_stream.wait_stream(self._copy_torch_stream)
