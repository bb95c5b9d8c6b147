"""Fresh stores for scenarios: a connector keeps its store in the working folder (files) or on a
shared server under `STORE_NAMESPACE_ENV`; a scope gives it a new one of each."""

from __future__ import annotations

import contextlib
import os

from kvtool.connector.store_namespace import store_namespace


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
