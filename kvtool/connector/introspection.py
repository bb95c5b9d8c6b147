"""What a connector's scheduler may say of itself, typed, and the one accessor kvtool reads it by.

A scheduler is `Introspectable` when it has `kvtool_introspection() -> Introspection`. The older
hook, `kvtool_introspect() -> dict` with the same keys (docs/connector-guide.md), is still read
and converted; a scheduler with neither says nothing (`introspect` answers None).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Protocol, runtime_checkable


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

    @classmethod
    def from_mapping(cls, answer: Mapping[str, Any]) -> Introspection:
        """The known keys of a `kvtool_introspect()` answer (others are ignored)."""
        known = {f.name for f in fields(cls)}
        values = {key: value for key, value in answer.items() if key in known}
        if values.get("tracked_request_ids") is not None:
            values["tracked_request_ids"] = tuple(values["tracked_request_ids"])
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        """The `kvtool_introspect()` form: the fields said, ids as a list."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        if "tracked_request_ids" in out:
            out["tracked_request_ids"] = list(out["tracked_request_ids"])
        return out


@runtime_checkable
class Introspectable(Protocol):
    def kvtool_introspection(self) -> Introspection:
        """What the scheduler holds and has counted, now."""


def introspect(scheduler: object) -> Introspection | None:
    """What `scheduler` says of itself now: its `kvtool_introspection()`, else its dict hook
    `kvtool_introspect()` converted; None when it has neither."""
    if isinstance(scheduler, Introspectable):
        return scheduler.kvtool_introspection()
    legacy = getattr(scheduler, "kvtool_introspect", None)
    return Introspection.from_mapping(legacy()) if callable(legacy) else None
