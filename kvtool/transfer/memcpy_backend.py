"""`memcpy`: one cuMemcpyAsync per page, the baseline every connector starts with."""

from __future__ import annotations

from collections.abc import Sequence

from kvtool.transfer import cuda_runtime as rt
from kvtool.transfer.api import CopyOp
from kvtool.transfer.cuda_base import CudaBackendBase
from kvtool.transfer.descriptors import op_descriptors


class MemcpyBackend(CudaBackendBase):
    name = "memcpy"

    def enqueue(self, prepared: Sequence[CopyOp]) -> None:
        handle = int(self.stream.handle)
        for op in prepared:
            for src, dst, nbytes in op_descriptors(op).tolist():
                rt.memcpy_async(dst, src, nbytes, handle)
