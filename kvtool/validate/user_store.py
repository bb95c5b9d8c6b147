"""Store folders a user names in the environment: one such folder would outlive every engine of a
validate run (TensorRT-LLM's file examples read `CONNECTOR_CACHE_FOLDER`, and their own `main`
sets it), so every engine would see what earlier ones saved, while each must start cold. Validate
says so once, at the start, and points each variable at a folder of each engine's own instead; the
user's folder is never touched."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping

USER_STORE_FOLDERS = ("CONNECTOR_CACHE_FOLDER", "TLLM_CONNECTOR_CACHE_FOLDER", "SEMANTIC_CONNECTOR_CACHE_FOLDER")
"""The environment variables TensorRT-LLM's example connectors read their store folder from."""

def user_store_folders(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The store-folder variables the user set (name -> value), in USER_STORE_FOLDERS' order."""
    return {name: environ[name] for name in USER_STORE_FOLDERS if environ.get(name)}


def user_store_notice(found: Mapping[str, str]) -> str | None:
    """The one line validate says at the start when `found` is not empty, else None."""
    if not found:
        return None
    names = ", ".join(f"{name}={value}" for name, value in found.items())
    one = len(found) == 1
    return (f"{names} is set: a connector keeping its store in {'that folder' if one else 'those folders'} would "
            "share one store between every engine this run starts, and each must start with a cold store "
            f"(an earlier engine's blocks would be served, or fail to load, on a later one); validate points "
            f"{'it' if one else 'each'} at a fresh folder of each engine's own instead, and leaves "
            f"{'yours' if one else 'your folders'} untouched")


@contextlib.contextmanager
def engine_store_folders():
    """Within: every store-folder variable the user set names `./<variable, lower case>` in the
    current folder (absolute, so follower ranks and chdirs agree), made on entry; restored on exit."""
    found = user_store_folders()
    for name in found:
        folder = os.path.abspath(name.lower())
        os.makedirs(folder, exist_ok=True)
        os.environ[name] = folder
    try:
        yield
    finally:
        os.environ.update(found)
