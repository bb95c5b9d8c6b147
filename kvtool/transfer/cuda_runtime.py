"""PyCUDA, lazily: PyTorch's primary context, kernels compiled from cuda/ once per specialization,
streams, and a few driver entry points PyCUDA does not wrap (through ctypes on libcuda).

Importing this module imports PyCUDA; only the CUDA backends do, and only when asked for.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

# isort: split
# PyCUDA after torch, as before import order was enforced.
import pycuda.driver as cuda  # (the optional dependency; ImportError means "not available")

from kvtool.transfer import kernel_cache

CUDA_DIR = Path(os.environ.get("KVTOOL_CUDA_DIR", Path(__file__).resolve().parents[2] / "cuda"))
CU_STREAM_ATTRIBUTE_PRIORITY = 8
CU_STREAM_NON_BLOCKING = 1
CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1


@functools.lru_cache(maxsize=1)
def context() -> cuda.Context:
    """PyTorch's primary context (never a new one); `current()` makes it current for PyCUDA."""
    torch.cuda.init()
    torch.zeros(1, device="cuda")   # make sure the runtime has created the primary context
    cuda.init()
    return cuda.Device(torch.cuda.current_device()).retain_primary_context()


_main_push = threading.Lock()
_main_pushed = False


@contextlib.contextmanager
def current() -> Iterator[None]:
    """PyTorch's primary context current for PyCUDA in the calling thread while inside. PyCUDA's
    context stack is per thread, and PyCUDA aborts the process at exit when a thread's stack still
    holds one: the main thread pushes it once (popped at exit); any other thread (an asynchronous
    connector's copies) pushes it here and pops it again. Enqueued work goes on after the pop."""
    global _main_pushed
    ctx = context()
    if threading.current_thread() is threading.main_thread():
        with _main_push:
            if not _main_pushed:
                ctx.push()
                atexit.register(_pop, ctx)
                _main_pushed = True
        yield
        return
    ctx.push()
    try:
        yield
    finally:
        cuda.Context.pop()


def _pop(ctx) -> None:
    with contextlib.suppress(cuda.Error):
        ctx.pop()


@functools.cache
def module(source: str, defines: tuple[tuple[str, int], ...] = ()) -> cuda.Module:
    """cuda/`source` compiled for this device with `defines`, loaded once per specialization; the
    binary comes from `kernel_cache`, so a process whose specialization was compiled before (by
    any process) runs no nvcc."""
    major, minor = torch.cuda.get_device_capability()
    options = ["-O3", *(f"-D{k}={v}" for k, v in defines)]
    arch = f"sm_{major}{minor}"
    with current():
        try:
            return cuda.module_from_buffer(kernel_cache.cubin(CUDA_DIR / source, options, arch))
        except cuda.Error:      # a cached binary the driver refuses (damaged on disk): compile it again
            return cuda.module_from_buffer(kernel_cache.cubin(CUDA_DIR / source, options, arch, fresh=True))


def kernel(source: str, name: str, defines: tuple[tuple[str, int], ...] = ()) -> cuda.Function:
    """`name` from cuda/`source` with `defines` (see `module`)."""
    with current():
        return module(source, defines).get_function(name)


def new_stream(priority: int | None = None) -> tuple[cuda.Stream, torch.cuda.ExternalStream]:
    """A PyCUDA stream (optionally with a launch priority) and the same stream as seen by PyTorch."""
    with current():
        stream = cuda.Stream(CU_STREAM_NON_BLOCKING)   # a blocking stream would serialise with torch's default
        handle = int(stream.handle)
        if priority is not None:
            set_stream_priority(handle, priority)
    return stream, torch.cuda.ExternalStream(handle)


def num_sms() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


# ---- libcuda through ctypes --------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed with CUresult {result}")


def set_stream_priority(handle: int, priority: int) -> None:
    low, high = ctypes.c_int(), ctypes.c_int()
    _check(libcuda().cuCtxGetStreamPriorityRange(ctypes.byref(low), ctypes.byref(high)), "cuCtxGetStreamPriorityRange")
    value = (ctypes.c_byte * 64)()
    ctypes.c_int.from_buffer(value).value = max(high.value, min(low.value, priority))
    _check(libcuda().cuStreamSetAttribute(ctypes.c_void_p(handle), CU_STREAM_ATTRIBUTE_PRIORITY, value),
           "cuStreamSetAttribute(priority)")


def memcpy_async(dst: int, src: int, nbytes: int, stream_handle: int) -> None:
    """cuMemcpyAsync: memory types inferred from unified addresses (pinned host or device)."""
    _check(libcuda().cuMemcpyAsync(ctypes.c_uint64(dst), ctypes.c_uint64(src), ctypes.c_size_t(nbytes),
                                   ctypes.c_void_p(stream_handle)), "cuMemcpyAsync")


class _Memcpy2D(ctypes.Structure):
    _fields_ = [("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int),
                ("srcHost", ctypes.c_void_p), ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
                ("srcPitch", ctypes.c_size_t), ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t),
                ("dstMemoryType", ctypes.c_int), ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64),
                ("dstArray", ctypes.c_void_p), ("dstPitch", ctypes.c_size_t), ("WidthInBytes", ctypes.c_size_t),
                ("Height", ctypes.c_size_t)]


CU_MEMORYTYPE_UNIFIED = 4


def memcpy_2d_async(dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int,
                    stream_handle: int) -> None:
    """`height` rows of `width` bytes, each at its pitch: one copy-engine call for a strided run."""
    desc = _Memcpy2D(srcMemoryType=CU_MEMORYTYPE_UNIFIED, srcDevice=src, srcPitch=src_pitch,
                     dstMemoryType=CU_MEMORYTYPE_UNIFIED, dstDevice=dst, dstPitch=dst_pitch,
                     WidthInBytes=width, Height=height)
    _check(libcuda().cuMemcpy2DAsync_v2(ctypes.byref(desc), ctypes.c_void_p(stream_handle)), "cuMemcpy2DAsync")


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation), ("dstLocHint", _MemLocation),
                ("flags", ctypes.c_uint)]


def has_memcpy_batch() -> bool:
    """Whether the driver has cuMemcpyBatchAsync's CUDA 13 form (a 12.8-12.9 driver's has another signature)."""
    return hasattr(libcuda(), "cuMemcpyBatchAsync_v2")


def memcpy_batch_async(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream_handle: int) -> None:
    """cuMemcpyBatchAsync (CUDA 13 form): one driver call for the whole batch."""
    count = len(dsts)
    attrs = _MemcpyAttributes(srcAccessOrder=CU_MEMCPY_SRC_ACCESS_ORDER_STREAM)
    index = ctypes.c_size_t(0)
    _check(libcuda().cuMemcpyBatchAsync_v2(
        dsts.ctypes.data_as(ctypes.c_void_p), srcs.ctypes.data_as(ctypes.c_void_p),
        sizes.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(count), ctypes.byref(attrs), ctypes.byref(index),
        ctypes.c_size_t(1), ctypes.c_void_p(stream_handle)), "cuMemcpyBatchAsync")


# ---- CUDA graphs: a prepared batch replayed with one driver call ----------------------------------
CU_STREAM_CAPTURE_MODE_RELAXED = 2
CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY = 8


class Graph:
    """An instantiated CUDA graph. `keep` holds what its nodes read (descriptor tables, staging):
    the graph must not outlive them."""

    def __init__(self, graph: int, graph_exec: int, keep: object) -> None:
        self._graph, self._exec, self.keep = graph, graph_exec, keep

    def launch(self, stream_handle: int) -> None:
        _check(libcuda().cuGraphLaunch(ctypes.c_void_p(self._exec), ctypes.c_void_p(stream_handle)), "cuGraphLaunch")

    def __del__(self) -> None:
        try:    # at interpreter exit libcuda may already be gone: nothing to free then
            libcuda().cuGraphExecDestroy(ctypes.c_void_p(self._exec))
            libcuda().cuGraphDestroy(ctypes.c_void_p(self._graph))
        except Exception:   # noqa: BLE001
            pass


def capture(stream_handle: int, enqueue: Callable[[], None], keep: object) -> Graph:
    """What `enqueue` puts on `stream_handle` (and on streams it forks from there), as a graph.
    Kernel nodes keep their stream's priority."""
    lib = libcuda()
    _check(lib.cuStreamBeginCapture_v2(ctypes.c_void_p(stream_handle), ctypes.c_int(CU_STREAM_CAPTURE_MODE_RELAXED)),
           "cuStreamBeginCapture")
    graph = ctypes.c_void_p()
    try:
        enqueue()
    finally:
        ended = lib.cuStreamEndCapture(ctypes.c_void_p(stream_handle), ctypes.byref(graph))
    _check(ended, "cuStreamEndCapture")
    graph_exec = ctypes.c_void_p()
    _check(lib.cuGraphInstantiateWithFlags(ctypes.byref(graph_exec), graph,
                                           ctypes.c_ulonglong(CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY)),
           "cuGraphInstantiate")
    if graph.value is None or graph_exec.value is None:
        raise RuntimeError("a CUDA graph was captured, but the driver returned no graph")
    return Graph(graph.value, graph_exec.value, keep)
