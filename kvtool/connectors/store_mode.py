"""How a block-store connector moves blocks: the `mode` connector option."""

from __future__ import annotations

from collections.abc import Mapping

from kvtool.types import TextEnum


class StoreMode(TextEnum):
    SYNC = "sync"
    """Loads before the pass, saves after it, both inside the iteration."""
    ASYNC = "async"
    """Loads in the background (the request waits in transmission) and deferred saves after finish."""
    LAYERWISE = "layerwise"
    """Each layer is loaded just before it runs and saved just after."""


def store_mode(options: Mapping[str, str]) -> StoreMode:
    """The `mode` option (default sync); ValueError naming the choices for anything else."""
    text = options.get("mode", StoreMode.SYNC.value)
    try:
        return StoreMode(text)
    except ValueError:
        choices = ", ".join(m.value for m in StoreMode)
        raise ValueError(f"mode must be one of {choices}, got {text!r}") from None
