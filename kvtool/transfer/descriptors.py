"""Descriptor tables for the CUDA backends, built on the CPU (no CUDA needed, so it is tested in CI).

A descriptor is (src address, dst address, bytes) for one page copy or sub-slot chunk. The kernel
splits each into work chunks of `chunk_bytes`; `chunk_start[d]` is descriptor d's first chunk.
Descriptors whose addresses and size are all 16-byte aligned go to the vector kernel, the others
to the byte kernel.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtool.blocks import ceil_div
from kvtool.transfer.api import CopyOp

VECTOR_BYTES = 16
WARP = 32
DEFAULT_UNROLL = 8
DESC_DTYPE = np.dtype([("src", "<u8"), ("dst", "<u8"), ("nbytes", "<u8")])


def chunk_bytes(unroll: int = DEFAULT_UNROLL) -> int:
    """Bytes one warp moves per task: 32 lanes x 16 bytes x `unroll` loads in flight."""
    return WARP * VECTOR_BYTES * unroll


@dataclass(frozen=True)
class DescriptorTable:
    descs: np.ndarray
    chunk_start: np.ndarray
    num_chunks: int
    chunks_per_desc: int = 0
    """Chunks of every descriptor when they are all alike (the kernel's fast path); 0 otherwise."""

    @property
    def num_bytes(self) -> int:
        return int(self.descs["nbytes"].sum())

    def __len__(self) -> int:
        return len(self.descs)


def op_descriptors(op: CopyOp) -> np.ndarray:
    """One descriptor per (src slot, dst slot) pair of `op`."""
    descs = np.empty(len(op.src_slots), dtype=DESC_DTYPE)
    src_base = op.src.address(0, op.src_offset)
    dst_base = op.dst.address(0, op.dst_offset)
    descs["src"] = src_base + np.asarray(op.src_slots, dtype=np.uint64) * np.uint64(op.src.stride)
    descs["dst"] = dst_base + np.asarray(op.dst_slots, dtype=np.uint64) * np.uint64(op.dst.stride)
    descs["nbytes"] = op.nbytes
    return descs


def shifted_descriptors(descs: np.ndarray, src_shift: int, dst_shift: int) -> np.ndarray:
    """A copy of `descs` with every source address moved by `src_shift` bytes and every
    destination by `dst_shift` (either may be negative)."""
    out = descs.copy()
    out["src"] = (out["src"].astype(np.int64) + src_shift).astype(np.uint64)
    out["dst"] = (out["dst"].astype(np.int64) + dst_shift).astype(np.uint64)
    return out


def stacked_shifted_descriptors(descs: np.ndarray, shifts: Sequence[tuple[int, int]]) -> np.ndarray:
    """`shifted_descriptors(descs, s, d)` for each (s, d) of `shifts`, back to back, in one array
    operation (a layer-by-layer pass shifts one table 31 times)."""
    moves = np.asarray(shifts, dtype=np.int64).reshape(-1, 2)
    out = np.empty((len(moves), len(descs)), dtype=DESC_DTYPE)
    out["src"] = (descs["src"].astype(np.int64)[None, :] + moves[:, :1]).astype(np.uint64)
    out["dst"] = (descs["dst"].astype(np.int64)[None, :] + moves[:, 1:]).astype(np.uint64)
    out["nbytes"] = descs["nbytes"][None, :]
    return out.reshape(-1)


def shifted_copy(copy: PitchedCopy, src_shift: int, dst_shift: int) -> PitchedCopy:
    """`copy` with its source moved by `src_shift` bytes and its destination by `dst_shift`."""
    return PitchedCopy(copy.dst + dst_shift, copy.dst_pitch, copy.src + src_shift, copy.src_pitch, copy.width,
                       copy.rows)


def split_by_alignment(descs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(aligned to 16 bytes in src, dst and size; the rest)."""
    mask = np.uint64(VECTOR_BYTES - 1)
    aligned = ((descs["src"] | descs["dst"] | descs["nbytes"]) & mask) == 0
    return descs[aligned], descs[~aligned]


def build_table(descs: np.ndarray, unroll: int = DEFAULT_UNROLL) -> DescriptorTable:
    size = chunk_bytes(unroll)
    descs = descs[descs["nbytes"] > 0]
    chunks = (descs["nbytes"] + np.uint64(size - 1)) // np.uint64(size)
    chunk_start = np.zeros(len(descs), dtype=np.uint64)
    if len(descs):
        chunk_start[1:] = np.cumsum(chunks)[:-1]
    uniform = int(chunks[0]) if len(chunks) and bool((chunks == chunks[0]).all()) else 0
    return DescriptorTable(np.ascontiguousarray(descs), chunk_start, int(chunks.sum()), uniform)


def tables_for(ops: Sequence[CopyOp], unroll: int = DEFAULT_UNROLL) -> tuple[DescriptorTable, DescriptorTable]:
    """(vector table, byte-fallback table) for a batch."""
    descs = np.concatenate([op_descriptors(op) for op in ops]) if ops else np.empty(0, dtype=DESC_DTYPE)
    aligned, unaligned = split_by_alignment(descs)
    return build_table(aligned, unroll), build_table(unaligned, unroll)


def grid_blocks(num_chunks: int, threads: int, max_blocks: int) -> int:
    """Blocks for a launch: enough warps for every chunk, capped at `max_blocks` (bytes in flight =
    blocks x warps per block x chunk bytes; the cap is what keeps host transfers on few SMs)."""
    warps_per_block = threads // WARP
    return max(1, min(max_blocks, ceil_div(num_chunks, warps_per_block)))


def slot_runs(slots: np.ndarray) -> list[tuple[int, int]]:
    """(start index, length) of runs of consecutive values in `slots` (already in the wanted order)."""
    if not len(slots):
        return []
    breaks = np.nonzero(np.diff(slots) != 1)[0] + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(slots)]])
    return [(int(s), int(e - s)) for s, e in zip(starts, ends, strict=True)]


def paired_runs(host_slots: Sequence[int], gpu_slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """(host slot, gpu slot, length) of each run of pairs, taken in host-slot order, where both
    sides go up by one from pair to pair: one copy-engine call can carry a run whole, with no
    gather (a run of one pair is one page)."""
    host, gpu = np.asarray(host_slots, dtype=np.int64), np.asarray(gpu_slots, dtype=np.int64)
    order = np.argsort(host, kind="stable")
    host, gpu = host[order], gpu[order]
    if not len(host):
        return []
    breaks = np.nonzero((np.diff(host) != 1) | (np.diff(gpu) != 1))[0] + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(host)]])
    return [(int(host[s]), int(gpu[s]), int(e - s)) for s, e in zip(starts, ends, strict=True)]


@dataclass(frozen=True)
class PitchedCopy:
    """One copy-engine call: `rows` rows of `width` bytes, each row `*_pitch` bytes after the last."""

    dst: int
    dst_pitch: int
    src: int
    src_pitch: int
    width: int
    rows: int

    @property
    def is_flat(self) -> bool:
        """Back to back on both sides (or one row): one plain copy of width x rows bytes."""
        return self.rows == 1 or self.dst_pitch == self.src_pitch == self.width


def direct_copies(op: CopyOp, min_run_bytes: int) -> list[PitchedCopy] | None:
    """`op` as one copy per run of `paired_runs` (host slot order), where those runs hold at least
    `min_run_bytes` on average; None where they do not (or `min_run_bytes` is 0): then a gather
    into staging is worth its cost. Exactly one side of `op` must be host memory."""
    dst_host = op.dst.device.type == "cpu"
    host_slots, gpu_slots = (op.dst_slots, op.src_slots) if dst_host else (op.src_slots, op.dst_slots)
    runs = paired_runs(host_slots, gpu_slots)
    if not min_run_bytes or not runs or op.nbytes * len(host_slots) < min_run_bytes * len(runs):
        return None
    copies = []
    for host_slot, gpu_slot, rows in runs:
        src_slot, dst_slot = (gpu_slot, host_slot) if dst_host else (host_slot, gpu_slot)
        copies.append(PitchedCopy(op.dst.address(dst_slot, op.dst_offset), op.dst.stride,
                                  op.src.address(src_slot, op.src_offset), op.src.stride, op.nbytes, rows))
    return copies


@dataclass(frozen=True)
class RunBatch:
    """Copy-engine calls grouped for the driver: the flat ones as the arrays of one
    cuMemcpyBatchAsync (dst, src, bytes), the strided ones one 2D copy each."""

    dsts: np.ndarray
    srcs: np.ndarray
    sizes: np.ndarray
    strided: tuple[PitchedCopy, ...]


def run_batch(copies: Sequence[PitchedCopy]) -> RunBatch:
    """`copies` as one batch of plain copies (the flat ones, in order) and the strided rest: the
    copies of a batch may run in any order, so `copies` must not overlap (runs of distinct pages)."""
    flat = [c for c in copies if c.is_flat]
    return RunBatch(np.array([c.dst for c in flat], dtype=np.uint64), np.array([c.src for c in flat], dtype=np.uint64),
                    np.array([c.width * c.rows for c in flat], dtype=np.uint64),
                    tuple(c for c in copies if not c.is_flat))


def reference_run_batch(batch: RunBatch) -> None:
    """What the driver does with `batch`, by the CPU on live host addresses (tests use it)."""
    for dst, src, size in zip(batch.dsts.tolist(), batch.srcs.tolist(), batch.sizes.tolist(), strict=True):
        ctypes.memmove(dst, src, size)
    reference_pitched_copies(batch.strided)


def pipeline_chunks(num_rows: int, row_bytes: int, first_bytes: int, max_bytes: int) -> list[tuple[int, int]]:
    """(first row, rows) of each chunk of a pipelined staged copy: the first chunk about
    `first_bytes`, each next one twice the last, up to `max_bytes` (0: one chunk of every row).
    Why growing: the link idles only while the first chunk is gathered, so it is small; every
    chunk is one more copy-engine call with its own gap, so the rest are large. At least one row
    per chunk."""
    if num_rows <= 0:
        return []
    if max_bytes <= 0:
        return [(0, num_rows)]
    chunks, first, size = [], 0, max(1, min(first_bytes, max_bytes) // row_bytes)
    cap = max(1, max_bytes // row_bytes)
    while first < num_rows:
        rows = min(size, num_rows - first)
        chunks.append((first, rows))
        first += rows
        size = min(size * 2, cap)
    return chunks


def reference_pitched_copies(copies: Sequence[PitchedCopy]) -> None:
    """What the copy engine does with `copies`, by the CPU on live host addresses (tests use it)."""
    for copy in copies:
        for row in range(copy.rows):
            ctypes.memmove(copy.dst + row * copy.dst_pitch, copy.src + row * copy.src_pitch, copy.width)


def reference_copy(memory: np.ndarray, table: DescriptorTable, base: int) -> None:
    """What the kernels do, on one flat byte array whose address 0 is `base` (tests use it)."""
    for src, dst, nbytes in table.descs.tolist():
        memory[dst - base:dst - base + nbytes] = memory[src - base:src - base + nbytes].copy()
