"""`store_namespace`: run with shared-server stores scoped to a namespace of their own (see
`STORE_NAMESPACE_ENV`), for whoever needs a cold store on a server that outlives it: each
`kvtool validate` scenario, the store bench."""

from __future__ import annotations

import contextlib
import os
import uuid

from kvtool.connector.api import STORE_NAMESPACE_ENV


@contextlib.contextmanager
def store_namespace(part: str | None = None, label: str = "run"):
    """Keys of shared-server stores under a new namespace inside the current one: `part`, or a
    unique `{label}-{random}` when it is None (a server outlives every run). The previous
    namespace (or none) is back on exit."""
    previous = os.environ.get(STORE_NAMESPACE_ENV)
    part = part or f"{label}-{uuid.uuid4().hex[:12]}"
    os.environ[STORE_NAMESPACE_ENV] = f"{previous}:{part}" if previous else part
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(STORE_NAMESPACE_ENV, None)
        else:
            os.environ[STORE_NAMESPACE_ENV] = previous
