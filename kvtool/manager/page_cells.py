"""`PageCells`: every page of one pool group as cells of arrays indexed by slot.

A slot is free, a page in use (some cache or hold references it: a count above zero) or a
droppable page (only the radix tree references it). The cells of a page in use or droppable say
which layer group it belongs to, which tree node holds it (NO_NODE: none), its eviction priority,
how many active and held users it has and whether it is a scratch page; a free slot's cells mean
nothing until it is handed out again. There are no per-page objects: a trace keeps millions of
pages, and a prefill allocates and releases thousands at once with a few array operations.

The arrays are zeroed lazily (`lazy_zeros`): slots never handed out cost no memory.
"""

from __future__ import annotations

import numpy as np

from kvtool.manager.growable import lazy_zeros

NO_NODE = -1
"""`node` of a page no tree node holds (the same value as the tree's NO_NODE)."""


class PageCells:
    """Cells by slot of one pool group's `num_slots` pages (see the module docstring).

    Invariant: a slot with a count above zero is owned and not droppable; a scratch page is held
    by no node.
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.layer_group = lazy_zeros(num_slots, np.int8)   # a model has few layer groups
        self.node = lazy_zeros(num_slots, np.int32)
        self.priority = lazy_zeros(num_slots, np.int32)
        self.num_active = lazy_zeros(num_slots, np.int32)
        self.num_held = lazy_zeros(num_slots, np.int32)
        self.is_scratch = lazy_zeros(num_slots, np.bool_)

    def hand_out(self, slots: np.ndarray | slice | int, layer_group: int, active: bool,
                 is_scratch: bool = False) -> None:
        """Cells of freshly allocated pages: one user each (active or held), held by no node."""
        self.layer_group[slots] = layer_group
        self.node[slots] = NO_NODE
        self.num_active[slots] = 1 if active else 0
        self.num_held[slots] = 0 if active else 1
        self.is_scratch[slots] = is_scratch

    def in_use_mask(self) -> np.ndarray:
        """A boolean per slot: some cache or hold uses the page."""
        return (self.num_active != 0) | (self.num_held != 0)

    def num_users(self, slots: np.ndarray) -> np.ndarray:
        return self.num_active[slots] + self.num_held[slots]
