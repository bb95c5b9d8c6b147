"""`GroupPages`: page lists per layer group, the one type they travel in between kvtool's layers.

Shaped as TensorRT-LLM hands them to a connector: a sequence of per-group lists whose position is
the layer group id (`for group_id, pages in enumerate(by_group)`). The manager produces it
(`KvCache.page_indices_by_group`), the scheduler hands it to the connector runtime, which gives the
connector fresh `list[list[int]]` copies (`as_lists`), exactly TensorRT-LLM's `List[List[int]]`.

A page index is scoped to its layer group's pool group, so the lists are never merged across
groups; an entry is `BAD_PAGE_INDEX` where a block has no page (a stale block of a windowed group),
keeping every list positionally aligned to block ordinals.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from kvtool.types import BAD_PAGE_INDEX


def valid_page_slots(page_indices: Sequence[int]) -> Iterator[tuple[int, int]]:
    """(block ordinal, page index) for every entry that is a real page."""
    for ordinal, page in enumerate(page_indices):
        if page != BAD_PAGE_INDEX:
            yield ordinal, page


class GroupPages(Sequence[tuple[int, ...]]):
    """Immutable: entry `g` is layer group `g`'s page index per block ordinal.

    Compares equal to any sequence of the same per-group entries (lists or tuples).
    """

    __slots__ = ("_lists",)
    _lists: tuple[tuple[int, ...], ...]

    def __init__(self, lists: Iterable[Iterable[int]] = ()) -> None:
        if isinstance(lists, GroupPages):   # immutable: share, do not copy (a connector re-wraps them each pass)
            self._lists = lists._lists
            return
        self._lists = tuple(
            pages if type(pages) is tuple else tuple(map(int, pages)) for pages in lists)

    # ---- Sequence ----------------------------------------------------------------------------
    def __getitem__(self, layer_group_id):  # type: ignore[override]
        return self._lists[layer_group_id]

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        return iter(self._lists)

    def __len__(self) -> int:
        return len(self._lists)

    def items(self) -> Iterator[tuple[int, tuple[int, ...]]]:
        """(layer group id, page list) pairs: `enumerate(self)`."""
        return enumerate(self._lists)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, GroupPages):
            return self._lists == other._lists
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(other) == len(self._lists) and all(tuple(o) == p for o, p in zip(other, self._lists, strict=True))

    def __hash__(self) -> int:
        return hash(self._lists)

    def __repr__(self) -> str:
        return f"GroupPages({self.as_lists()})"

    # ---- views -------------------------------------------------------------------------------
    def as_lists(self) -> list[list[int]]:
        """Fresh `list[list[int]]` copies: what a connector receives (it may keep or change them)."""
        return [list(pages) for pages in self._lists]

    def flat(self) -> list[int]:
        """The flat list the single-group API carries: the only group's list, or [] with several
        (there is no correct flattening of page indices scoped to different groups)."""
        return list(self._lists[0]) if len(self._lists) == 1 else []

    def valid(self, layer_group_id: int) -> Iterator[tuple[int, int]]:
        """(block ordinal, page index) for the real pages of one group (none for a group past the end)."""
        pages = self._lists[layer_group_id] if 0 <= layer_group_id < len(self._lists) else ()
        return valid_page_slots(pages)

    def lengths(self) -> tuple[int, ...]:
        """Entries per group: what a receiver of append-deltas has seen after this one."""
        return tuple(len(p) for p in self._lists)

    # ---- append-deltas -----------------------------------------------------------------------
    def since(self, seen: Sequence[int]) -> GroupPages:
        """The delta after the first `seen[g]` entries of each group (a group not seen: all of it)."""
        return GroupPages(p[seen[g]:] if g < len(seen) else p for g, p in enumerate(self._lists))

    def extended(self, delta: Sequence[Sequence[int]]) -> GroupPages:
        """These lists with `delta[g]` appended to group `g` (the receiving side of `since`)."""
        # Tuples joined, not lists rebuilt: a decode step's delta is a page or none, and converting
        # every earlier entry again would cost a long request O(blocks) a step.
        lists = self._lists + ((),) * max(len(delta) - len(self._lists), 0)
        return GroupPages(p + tuple(map(int, delta[g])) if g < len(delta) and len(delta[g]) else p
                          for g, p in enumerate(lists))
