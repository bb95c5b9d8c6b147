"""Fresh stores for scenarios: a connector keeps its store in the working folder (files), in a
folder a user-set variable names (`user_store`), or on a shared server under `STORE_NAMESPACE_ENV`;
a scope gives it a new one of each."""

from __future__ import annotations

import contextlib
import os

from kvtool.connector.store_namespace import store_namespace
from kvtool.validate.user_store import engine_store_folders


@contextlib.contextmanager
def own_store(name: str):
    """Run in a fresh subfolder of the working folder, under a namespace of its own, with the store
    folders a user set in the environment pointed inside it."""
    here = os.getcwd()
    os.makedirs(name, exist_ok=True)
    os.chdir(name)
    try:
        with store_namespace(name), engine_store_folders():
            yield
    finally:
        os.chdir(here)
