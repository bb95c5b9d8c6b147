"""Backends by name. CUDA backends are imported lazily so the CPU path never touches PyCUDA."""

from __future__ import annotations

import functools
import importlib
import warnings
from collections.abc import Callable

import torch

from kvtool.errors import InputError
from kvtool.transfer.api import TransferBackend

_BACKENDS: dict[str, str] = {
    "torch": "kvtool.transfer.torch_backend:TorchBackend",
    "kernel": "kvtool.transfer.kernel_backend:KernelBackend",
    "staged": "kvtool.transfer.staged_backend:StagedBackend",
    "memcpy": "kvtool.transfer.memcpy_backend:MemcpyBackend",
    "batch": "kvtool.transfer.batch_backend:BatchBackend",
}
_CUDA_ONLY = {"kernel", "staged", "memcpy", "batch"}
AUTO = "auto"
"""The built-in connectors' default: `best_backend` for where the pages live."""
GPU_DEFAULT = "staged"
"""Why staged: results/h200-link-study (the copy engines carry the bytes, and a concurrent matmul
loses the least). Saves and loads at once keep the bidirectional link only on two instances (two
copy streams); one instance's copies queue on its one copy stream."""


def backend_names() -> list[str]:
    return list(_BACKENDS)


def best_backend(device: torch.device) -> str:
    """`staged` for pages on a GPU where PyCUDA runs, otherwise `torch` (always available)."""
    if device.type != "cuda":
        return "torch"
    why_not = _why_gpu_default_cannot_run()
    if why_not:
        warnings.warn(f"backend auto: {GPU_DEFAULT} cannot run here ({why_not}); using torch", stacklevel=2)
        return "torch"
    return GPU_DEFAULT


@functools.lru_cache(maxsize=1)
def _why_gpu_default_cannot_run() -> str | None:
    """Tried once per process, whatever the outcome: a backend owns streams and buffers, a failure
    may cost an nvcc run, and every registration asks."""
    try:
        get_backend(GPU_DEFAULT)
    except Exception as exc:    # noqa: BLE001 - no nvcc, a driver mismatch: whatever stops it, torch works
        return f"{type(exc).__name__}: {exc}"
    return None


def _factory(name: str) -> Callable[[], TransferBackend]:
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def get_backend(name: str, **options) -> TransferBackend:
    """A backend instance (`options` go to its constructor, e.g. `priority`); InputError for an
    unknown name or one this machine cannot run."""
    if name not in _BACKENDS:
        raise InputError(f"unknown transfer backend {name!r}; known: {', '.join(_BACKENDS)}")
    if name in _CUDA_ONLY and not torch.cuda.is_available():
        raise InputError(f"transfer backend {name!r} needs a CUDA GPU")
    try:
        return _factory(name)(**options)
    except ImportError as exc:
        raise InputError(f"transfer backend {name!r} is not available here: {exc}") from None


def available_backends() -> list[str]:
    """Names of the backends that can run on this machine (torch first)."""
    names = ["torch"]
    if not torch.cuda.is_available():
        return names
    for name in backend_names()[1:]:
        try:
            backend = _factory(name)()
        except (ImportError, InputError, RuntimeError):
            continue
        if getattr(backend, "is_supported", lambda: True)():
            names.append(name)
    return names
