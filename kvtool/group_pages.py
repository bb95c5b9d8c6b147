"""`GroupPages`: page lists per layer group, the one type they travel in between layers.

The manager produces it (`KvCache.page_indices_by_group`), the scheduler hands it to the connector
runtime, `RequestData` carries append-deltas of it, and connectors read it. A page index is scoped
to its layer group's pool group, so the lists are never merged across groups; an entry is
`BAD_PAGE_INDEX` where a block has no page (a stale block of a windowed group), keeping every list
positionally aligned to block ordinals.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Mapping, Sequence

from kvtool.types import BAD_PAGE_INDEX


def valid_page_slots(page_indices: Sequence[int]) -> Iterator[tuple[int, int]]:
    """(block ordinal, page index) for every entry that is a real page."""
    for ordinal, page in enumerate(page_indices):
        if page != BAD_PAGE_INDEX:
            yield ordinal, page


class GroupPages(Mapping[int, tuple[int, ...]]):
    """Immutable: layer group id -> page index per block ordinal, in group order.

    Compares equal to any mapping with the same groups and the same entries (lists or tuples).
    """

    __slots__ = ("_lists",)

    def __init__(self, lists: Mapping[int, Iterable[int]] | Iterable[tuple[int, Iterable[int]]] = ()) -> None:
        if isinstance(lists, GroupPages):   # immutable: share, do not copy (a connector re-wraps them each pass)
            self._lists = lists._lists
            return
        items = lists.items() if isinstance(lists, Mapping) else lists
        self._lists: dict[int, tuple[int, ...]] = {int(g): tuple(map(int, pages)) for g, pages in items}

    # ---- Mapping -----------------------------------------------------------------------------
    def __getitem__(self, layer_group_id: int) -> tuple[int, ...]:
        return self._lists[layer_group_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._lists)

    def __len__(self) -> int:
        return len(self._lists)

    # The Mapping mixins go through __getitem__ for every entry; connectors walk these per block.
    def items(self):
        return self._lists.items()

    def keys(self):
        return self._lists.keys()

    def values(self):
        return self._lists.values()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        return self.keys() == other.keys() and all(tuple(other[g]) == p for g, p in self._lists.items())

    def __hash__(self) -> int:
        return hash(tuple(self._lists.items()))

    def __repr__(self) -> str:
        return f"GroupPages({ {g: list(p) for g, p in self._lists.items()} })"

    # ---- views -------------------------------------------------------------------------------
    def flat(self) -> list[int]:
        """The flat list the single-group API carries: the only group's list, or [] with several
        (there is no correct flattening of page indices scoped to different groups)."""
        return list(next(iter(self._lists.values()))) if len(self._lists) == 1 else []

    def valid(self, layer_group_id: int) -> Iterator[tuple[int, int]]:
        """(block ordinal, page index) for the real pages of one group."""
        return valid_page_slots(self._lists.get(layer_group_id, ()))

    def lengths(self) -> dict[int, int]:
        """Entries per group: what a receiver of append-deltas has seen after this one."""
        return {g: len(p) for g, p in self._lists.items()}

    # ---- append-deltas -----------------------------------------------------------------------
    def since(self, seen: Mapping[int, int]) -> "GroupPages":
        """The delta after the first `seen[g]` entries of each group (a group not seen: all of it)."""
        return GroupPages((g, p[seen.get(g, 0):]) for g, p in self._lists.items())

    def extended(self, delta: Mapping[int, Sequence[int]]) -> "GroupPages":
        """These lists with `delta` appended per group (the receiving side of `since`)."""
        merged = {g: list(p) for g, p in self._lists.items()}
        for g, pages in delta.items():
            merged.setdefault(int(g), []).extend(pages)
        return GroupPages(merged)
