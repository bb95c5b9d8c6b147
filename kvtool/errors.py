"""The exception tree. Every error kvtool raises on purpose derives from `KvToolError`.

- `InputError`: bad user input (unknown model, malformed file, impossible size): the CLI exits 2.
- `OutOfMemoryError` / `OutOfPagesError`: the cache cannot hold what was asked.
- `IterationLimitError`: a replay did not finish within its iteration limit (the CLI exits 1).
- `LogicError`: a broken contract or invariant inside the manager or the runtime (a bug somewhere).
- `LayoutError`: a layout query outside what the layout describes.
- `ConnectorError`: a connector broke the connector API contract or raised from a hook.
- `IntegrityError`: KV bytes differ from what a full recompute would have written.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class KvToolError(Exception):
    """Base of every deliberate kvtool error."""


class InputError(KvToolError):
    """User input that cannot be used; the message says what and why, in one line."""


class OutOfMemoryError(KvToolError):
    """The configured memory cannot hold the requested storage."""


class OutOfPagesError(OutOfMemoryError):
    """No free or evictable slot is left in a pool group."""


class IterationLimitError(KvToolError):
    """Requests were still unfinished when the engine reached its iteration limit."""


class LogicError(KvToolError):
    """A contract or invariant was broken: a bug in the caller or in kvtool."""


class LayoutError(KvToolError):
    """A query outside what a layout describes (unknown layer group, layer, or view)."""


class UnknownLayerGroupError(LayoutError, KeyError):
    """`layout.group(id)` / `group_of_layer(layer)` for what the layout lacks: a KeyError, as
    TensorRT-LLM raises there."""

    def __str__(self) -> str:   # KeyError quotes its message
        return str(self.args[0]) if self.args else ""


class UnsupportedTierError(KvToolError):
    """A cache tier that the bundled manager or a connector cannot work with."""


class ConnectorError(KvToolError):
    """A connector broke the API contract, or one of its hooks raised."""


class LayoutNotSupportedError(ConnectorError, NotImplementedError):
    """A worker that takes one pool tensor was handed a KV cache that is not one (TensorRT-LLM
    raises NotImplementedError there)."""


class RefusedSetupError(ConnectorError, InputError):
    """A runtime refuses to run this setup with a connector attached (TensorRT-LLM's bring-up
    checks, said in its terms). `blames_connector`: the connector's classes are the reason (a
    partial implementation); else the model or the configuration is (VSWA on V1, a host tier)."""

    def __init__(self, message: str, blames_connector: bool = False) -> None:
        super().__init__(message)
        self.blames_connector = blames_connector


class IntegrityError(KvToolError):
    """KV bytes differ from what a full recompute would have written."""


class ConstructionError(InputError):
    """A connector's scheduler or worker raised from its constructor."""


def did_you_mean(name: str, choices: Iterable[object], cutoff: float = 0.6) -> str:
    """" (did you mean 'x'?)" naming the closest of `choices` to a mistyped `name`, or "" when none
    is close enough (`cutoff`, difflib's similarity in [0, 1]); for the end of an error message."""
    close = difflib.get_close_matches(name, [str(c) for c in choices], n=1, cutoff=cutoff)
    return f" (did you mean {close[0]!r}?)" if close else ""
