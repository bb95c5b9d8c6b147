"""`kernel`: zero-copy SM kernels over unified addresses; one launch per batch.

Host transfers run on few SMs (`max_sms` blocks of 1024 threads, about 1 MiB in flight), GPU-to-GPU
gathers on the whole GPU unless `device_max_blocks` caps them (measured in results/h200-link-study:
beside a matmul a capped gather is starved, so staged caps it only when asked). Descriptors not
16-byte aligned go to a byte-copy fallback launch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtool.errors import LogicError
from kvtool.transfer import cuda_runtime as rt
from kvtool.transfer.api import CopyOp
from kvtool.transfer.cuda_base import CudaBackendBase, is_host
from kvtool.transfer.descriptors import (
    DEFAULT_UNROLL,
    VECTOR_BYTES,
    DescriptorTable,
    grid_blocks,
    stacked_shifted_descriptors,
    tables_for,
)

HOST_THREADS = 1024
DEVICE_THREADS = 512


@dataclass
class Launch:
    function: Any
    """The compiled kernel (a PyCUDA function)."""
    descs: torch.Tensor
    chunk_start: torch.Tensor
    num_descs: int
    num_chunks: int
    chunks_per_desc: int
    blocks: int
    threads: int


class KernelBackend(CudaBackendBase):
    name = "kernel"

    def __init__(self, max_sms: int = 8, unroll: int = DEFAULT_UNROLL, priority: int | None = None,
                 load_hint: int = 0, store_hint: int = 0, host_threads: int = HOST_THREADS,
                 device_threads: int = DEVICE_THREADS, device_blocks_per_sm: int = 2,
                 device_max_blocks: int | None = None, graphed: bool = False) -> None:
        super().__init__(priority, graphed)
        self.max_sms = max_sms
        self.unroll = unroll
        self.host_threads = host_threads
        self.device_threads = device_threads
        self.device_blocks_per_sm = device_blocks_per_sm
        self.device_max_blocks = device_max_blocks
        defines = (("KVTOOL_UNROLL", unroll), ("KVTOOL_LOAD_HINT", load_hint), ("KVTOOL_STORE_HINT", store_hint))
        self._vector = rt.kernel("copy_pages.cu", "copy_pages_vec16", defines)
        self._bytes = rt.kernel("copy_pages.cu", "copy_pages_bytes", defines)

    def build(self, ops: Sequence[CopyOp]) -> list[Launch]:
        host = any(is_host(op) for op in ops)
        threads = self.host_threads if host else self.device_threads
        cap = self.max_sms if host else (self.device_max_blocks or self.device_blocks_per_sm * rt.num_sms())
        vector, fallback = tables_for(ops, self.unroll)
        return [self._upload(fn, table, threads, cap) for fn, table in ((self._vector, vector), (self._bytes, fallback))
                if len(table)]

    def build_shifted(self, ops: Sequence[CopyOp], shifts: Sequence[tuple[int, int]]) -> list[list[Launch]]:
        """`build(ops)` once per (src shift, dst shift) of `shifts`: the same copies moved by those
        byte offsets, each table built once and uploaded once for all of them. Every shift must be
        a multiple of 16 bytes (a descriptor then keeps its kernel); LogicError otherwise."""
        if any(s % VECTOR_BYTES or d % VECTOR_BYTES for s, d in shifts):
            raise LogicError("a shifted batch moves addresses by multiples of 16 bytes only")
        host = any(is_host(op) for op in ops)
        threads = self.host_threads if host else self.device_threads
        cap = self.max_sms if host else (self.device_max_blocks or self.device_blocks_per_sm * rt.num_sms())
        per_shift: list[list[Launch]] = [[] for _ in shifts]
        for function, table in zip((self._vector, self._bytes), tables_for(ops, self.unroll), strict=True):
            if len(table):
                shifted = self._upload_shifted(function, table, shifts, threads, cap)
                for launches, launch in zip(per_shift, shifted, strict=True):
                    launches.append(launch)
        return per_shift

    def _upload_shifted(self, function, table: DescriptorTable, shifts: Sequence[tuple[int, int]], threads: int,
                        cap: int) -> list[Launch]:
        stacked = stacked_shifted_descriptors(table.descs, shifts)
        descs = torch.from_numpy(stacked.view(np.uint64).copy()).cuda()
        starts = torch.from_numpy(table.chunk_start.copy()).cuda()
        threads = min(threads, function.get_attribute(rt.cuda.function_attribute.MAX_THREADS_PER_BLOCK))
        words = 3 * len(table)
        return [Launch(function, descs[i * words:(i + 1) * words], starts, len(table), table.num_chunks,
                       table.chunks_per_desc, grid_blocks(table.num_chunks, threads, cap), threads)
                for i in range(len(shifts))]

    def _upload(self, function, table: DescriptorTable, threads: int, cap: int) -> Launch:
        descs = torch.from_numpy(table.descs.view(np.uint64).copy()).cuda()
        starts = torch.from_numpy(table.chunk_start.copy()).cuda()
        threads = min(threads, function.get_attribute(rt.cuda.function_attribute.MAX_THREADS_PER_BLOCK))
        return Launch(function, descs, starts, len(table), table.num_chunks, table.chunks_per_desc,
                      grid_blocks(table.num_chunks, threads, cap), threads)

    def enqueue(self, prepared: list[Launch], stream=None) -> None:
        """Launch on `stream` (a PyCUDA stream; default the backend's own), with no ordering of its own."""
        stream = stream or self.stream
        for launch in prepared:
            launch.function(np.uintp(launch.descs.data_ptr()), np.uintp(launch.chunk_start.data_ptr()),
                            np.int32(launch.num_descs), np.uint64(launch.num_chunks),
                            np.uint64(launch.chunks_per_desc),
                            block=(launch.threads, 1, 1), grid=(launch.blocks, 1), stream=stream)
