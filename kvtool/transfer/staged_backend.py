"""`staged`: a GPU gather into a contiguous staging buffer, then copy-engine copies on their own
stream (and the reverse for loads). Two SM kernels streaming over PCIe in opposite directions fight
over the link; copy engines in opposite directions do not, so this keeps both directions fast when
saves and loads overlap. The host side is copied in runs of consecutive slots (one strided 2D copy
per run), so it is fast when a connector gives a batch consecutive store slots.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from kvtool.errors import LogicError
from kvtool.transfer import cuda_runtime as rt
from kvtool.transfer.api import CopyOp, PageSpace
from kvtool.transfer.cuda_base import CudaBackendBase
from kvtool.transfer.descriptors import slot_runs
from kvtool.transfer.kernel_backend import KernelBackend


class StagedBackend(CudaBackendBase):
    name = "staged"

    def __init__(self, priority: int | None = None) -> None:
        super().__init__(priority)
        self._gather = KernelBackend(max_sms=rt.num_sms())
        self._copy_stream, self._copy_torch_stream = rt.new_stream(priority)

    def enqueue(self, prepared: Sequence[CopyOp]) -> None:
        for op in prepared:
            src_host, dst_host = op.src.device.type == "cpu", op.dst.device.type == "cpu"
            if src_host and dst_host:
                raise LogicError("the staged backend moves data to or from the GPU")
            if not src_host and not dst_host:
                self._on(self.torch_stream, self._gather, [op])
            elif dst_host:
                self._save(op)
            else:
                self._load(op)

    def _save(self, op: CopyOp) -> None:
        order = np.argsort(np.asarray(op.dst_slots), kind="stable")
        staging = self._staging(len(order), op.nbytes)
        gather = CopyOp(op.src, staging, tuple(np.asarray(op.src_slots)[order].tolist()),
                        tuple(range(len(order))), op.nbytes, op.src_offset, 0)
        self._on(self.torch_stream, self._gather, [gather])
        self._copy_torch_stream.wait_stream(self.torch_stream)
        dst_slots = np.asarray(op.dst_slots)[order]
        for start, length in slot_runs(dst_slots):
            rt.memcpy_2d_async(op.dst.address(int(dst_slots[start]), op.dst_offset), op.dst.stride,
                               staging.address(start), op.nbytes, op.nbytes, length, int(self._copy_stream.handle))
        self.torch_stream.wait_stream(self._copy_torch_stream)

    def _load(self, op: CopyOp) -> None:
        order = np.argsort(np.asarray(op.src_slots), kind="stable")
        staging = self._staging(len(order), op.nbytes)
        src_slots = np.asarray(op.src_slots)[order]
        self._copy_torch_stream.wait_stream(self.torch_stream)
        for start, length in slot_runs(src_slots):
            rt.memcpy_2d_async(staging.address(start), op.nbytes, op.src.address(int(src_slots[start]), op.src_offset),
                               op.src.stride, op.nbytes, length, int(self._copy_stream.handle))
        self.torch_stream.wait_stream(self._copy_torch_stream)
        scatter = CopyOp(staging, op.dst, tuple(range(len(order))),
                         tuple(np.asarray(op.dst_slots)[order].tolist()), op.nbytes, 0, op.dst_offset)
        self._on(self.torch_stream, self._gather, [scatter])

    def _staging(self, rows: int, row_bytes: int) -> PageSpace:
        tensor = torch.empty(rows * row_bytes, dtype=torch.uint8, device="cuda")
        tensor.record_stream(self.torch_stream)
        tensor.record_stream(self._copy_torch_stream)
        return PageSpace.contiguous(tensor, row_bytes)

    def _on(self, stream: torch.cuda.ExternalStream, backend: KernelBackend, ops: list[CopyOp]) -> None:
        """Run the gather kernel on `stream` (the gather backend's own stream, bracketed by waits)."""
        prepared = backend.prepare(ops)
        backend.torch_stream.wait_stream(stream)
        backend.enqueue(prepared)
        stream.wait_stream(backend.torch_stream)
