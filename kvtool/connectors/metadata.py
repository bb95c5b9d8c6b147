"""What the block-store scheduler sends its workers each iteration."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple


class PageTransfer(NamedTuple):
    """Move one page of one layer group between the cache and the store. A named tuple, not a
    frozen dataclass: a block-fidelity replay builds one per saved block, millions of them, and a
    frozen dataclass costs three times as much to build."""

    request_id: int
    layer_group_id: int
    block_ordinal: int
    page: int
    location: Any
    """Where the block lives in the store: a slot (host) or a file path (disk)."""
    key: bytes


@dataclass
class StoreMetadata:
    loads: list[PageTransfer] = field(default_factory=list)
    """Synchronous loads: landed before the layers of this pass read them."""
    async_loads: dict[int, list[PageTransfer]] = field(default_factory=dict)
    """Per request: loads reported through get_finished."""
    saves: list[PageTransfer] = field(default_factory=list)
    """Blocks completed by this pass, saved before wait_for_save returns."""
    prefix_loads: list[int] = field(default_factory=list)
    """Reservation ids whose confirmed prefix load is among `loads` (reported by
    `get_finished_prefix_loads` once the pass that carried them ran)."""
    async_prefix_loads: dict[int, list[PageTransfer]] = field(default_factory=dict)
    """Per reservation id: a confirmed prefix load moved in the background, reported once landed."""
    async_saves: dict[int, list[PageTransfer]] = field(default_factory=dict)
    """Per request: blocks completed by this pass, saved in the background from the end of the
    pass; reported through get_finished once the request finished (pages held until then)."""
