"""Fresh stores for scenarios: a connector keeps its store in the working folder (files) or on a
shared server under `STORE_NAMESPACE_ENV`; a scope gives it a new one of each."""

from __future__ import annotations

import contextlib
import os
import uuid

from kvtool.connector.api import STORE_NAMESPACE_ENV


@contextlib.contextmanager
def store_namespace(part: str | None = None):
    """Keys of shared-server stores under a new namespace inside the current one (a unique one
    when `part` is None: a server outlives every run)."""
    previous = os.environ.get(STORE_NAMESPACE_ENV)
    part = part or f"validate-{uuid.uuid4().hex[:12]}"
    os.environ[STORE_NAMESPACE_ENV] = f"{previous}:{part}" if previous else part
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(STORE_NAMESPACE_ENV, None)
        else:
            os.environ[STORE_NAMESPACE_ENV] = previous


@contextlib.contextmanager
def own_store(name: str):
    """Run in a fresh subfolder of the working folder, under a namespace of its own."""
    here = os.getcwd()
    os.makedirs(name, exist_ok=True)
    os.chdir(name)
    try:
        with store_namespace(name):
            yield
    finally:
        os.chdir(here)
