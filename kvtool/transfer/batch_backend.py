"""`batch`: cuMemcpyBatchAsync, one driver call per batch (where the driver offers it)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtool.transfer import cuda_runtime as rt
from kvtool.transfer.api import CopyOp
from kvtool.transfer.cuda_base import CudaBackendBase
from kvtool.transfer.descriptors import op_descriptors


class BatchBackend(CudaBackendBase):
    name = "batch"

    def is_supported(self) -> bool:
        return rt.has_memcpy_batch()

    def build(self, ops: Sequence[CopyOp]) -> np.ndarray:
        return np.concatenate([op_descriptors(op) for op in ops])

    def enqueue(self, prepared: np.ndarray) -> None:
        dsts = np.ascontiguousarray(prepared["dst"])
        srcs = np.ascontiguousarray(prepared["src"])
        sizes = np.ascontiguousarray(prepared["nbytes"])
        rt.memcpy_batch_async(dsts, srcs, sizes, int(self.stream.handle))
