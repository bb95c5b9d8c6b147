"""What a connector's scheduler may say of itself, typed, and the one accessor kvtool reads it by.

A scheduler is `Introspectable` when it has `kvtool_introspection() -> Introspection`; one without
says nothing (`introspect` answers None). That is the one hook: the retired dict hook
`kvtool_introspect()` is refused when a connector is loaded (`retired_hook_error`), never read.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class Introspection:
    """Each field None where the connector did not say."""

    tracked_request_ids: tuple[int, ...] | None = None
    """Requests the scheduler still holds state for."""
    pinned_entries: int | None = None
    """Store entries held for a load in flight."""
    saved_blocks: int | None = None
    """Blocks saved since construction."""
    loaded_blocks: int | None = None
    """Blocks loaded since construction."""
    evicted_entries: int | None = None
    """Entries the connector's tier dropped to make room."""
    stored_entries: int | None = None
    staged_bytes: int | None = None
    ask_errors: int | None = None
    corrupt_entries: int | None = None
    tier_hit_tokens: tuple[tuple[str, int], ...] | None = None
    """Tokens delivered from each tier, for a connector of several (name, tokens), fastest first."""

    def as_dict(self) -> dict[str, Any]:
        """The fields said, ids as a list (a JSON object)."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        if "tracked_request_ids" in out:
            out["tracked_request_ids"] = list(out["tracked_request_ids"])
        return out


@runtime_checkable
class Introspectable(Protocol):
    def kvtool_introspection(self) -> Introspection:
        """What the scheduler holds and has counted, now."""


def introspect(scheduler: object) -> Introspection | None:
    """What `scheduler` says of itself now through `kvtool_introspection()`; None without it."""
    return scheduler.kvtool_introspection() if isinstance(scheduler, Introspectable) else None


def retired_hook_error(scheduler_class: type) -> str | None:
    """What is wrong with a scheduler class that still has only the retired dict hook; None if nothing."""
    if callable(getattr(scheduler_class, "kvtool_introspect", None)) and \
            not callable(getattr(scheduler_class, "kvtool_introspection", None)):
        return (f"{scheduler_class.__name__}.kvtool_introspect() (a dict) is no longer read: define "
                "kvtool_introspection() returning kvtool.connector.introspection.Introspection, with the same "
                "names as fields (docs/connector-guide.md, Options and introspection)")
    return None
