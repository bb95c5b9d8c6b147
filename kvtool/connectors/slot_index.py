"""Which store slot holds which block, for one layer group of a bounded tier, and which block goes
when the tier is full: the eviction policy.

Every policy keeps the same contract: `lookup` finds a key and counts it as used, `reserve` hands
a new key a slot (a never-used one first, then a freed one, then the victim's) or None when the key
is already there or every slot is pinned, pinned slots are never evicted. Policies differ only in
the victim:

- `lru`: the least recently used (looked up or added).
- `lfu`: the least frequently used (uses = lookups + 1 for the add), ties to the least recently
  used. In a prefix cache the blocks many prompts share (a system prompt's) are looked up by each,
  so LFU keeps them over one conversation's tail, which LRU keeps while it is recent.

The shared remote tier (`redis_store`) ranks its keys the same way, so a bounded Redis tier and
the in-process index of the same capacity make the same choices.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict, deque
from collections.abc import Callable


class SlotIndex:
    """LRU map from block key to store slot for one layer group; pinned slots are never evicted."""

    policy = "lru"

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._num_fresh = 0
        """Slots [0, _num_fresh) were handed out once; the rest never (so a huge index costs nothing)."""
        self._free: deque[int] = deque()
        self._entries: OrderedDict[bytes, int] = OrderedDict()
        self._pins: Counter = Counter()
        self.num_evictions = 0

    def lookup(self, key: bytes) -> int | None:
        slot = self._entries.get(key)
        if slot is not None:
            self._used(key)
        return slot

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def reserve(self, key: bytes) -> int | None:
        if key in self._entries:
            return None
        if self._num_fresh < self.num_slots:
            slot = self._num_fresh
            self._num_fresh += 1
        elif self._free:
            slot = self._free.popleft()
        else:
            victim = self._victim(lambda k: not self._pins[self._entries[k]])
            if victim is None:
                return None
            slot = self._entries.pop(victim)
            self.num_evictions += 1
        self._entries[key] = slot
        self._added(key)
        return slot

    def discard(self, key: bytes) -> None:
        """Drop `key` and free its slot (an entry whose bytes were never written)."""
        slot = self._entries.pop(key, None)
        if slot is not None and not self._pins[slot]:
            self._free.append(slot)
        elif slot is not None:
            self._entries[key] = slot    # a pending load holds it: it must stay until unpinned

    def pin(self, slot: int) -> None:
        self._pins[slot] += 1

    def unpin(self, slot: int) -> None:
        self._pins[slot] -= 1
        if self._pins[slot] <= 0:
            del self._pins[slot]

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_pinned(self) -> int:
        return sum(self._pins.values())

    # ---- the policy (LRU here: the entries' own order) -------------------------------------------
    def _used(self, key: bytes) -> None:
        """`key` was looked up."""
        self._entries.move_to_end(key)

    def _added(self, key: bytes) -> None:
        """`key` was just given a slot (it is the last of `_entries`)."""

    def _victim(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        """The key to evict among those `evictable` says may go; None when none may."""
        return next((k for k in self._entries if evictable(k)), None)


class LfuSlotIndex(SlotIndex):
    """LFU: the victim is the key used least often (ties: the least recently used). Ranks are kept
    in a heap of (uses, tick, key) with stale records skipped, so a choice costs O(log n)."""

    policy = "lfu"

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self._rank: dict[bytes, tuple[int, int]] = {}
        self._heap: list[tuple[int, int, bytes]] = []
        self._tick = 0

    def _used(self, key: bytes) -> None:
        uses, _ = self._rank[key]
        self._rank_as(key, uses + 1)

    def _added(self, key: bytes) -> None:
        self._rank_as(key, 1)

    def _rank_as(self, key: bytes, uses: int) -> None:
        self._tick += 1
        self._rank[key] = (uses, self._tick)
        heapq.heappush(self._heap, (uses, self._tick, key))
        if len(self._heap) > 4 * len(self._rank) + 64:
            self._compact()

    def _victim(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        held: list[tuple[int, int, bytes]] = []
        victim = None
        while self._heap:
            record = heapq.heappop(self._heap)
            uses, tick, key = record
            if self._rank.get(key) != (uses, tick) or key not in self._entries:
                continue                                   # stale: used since, or gone
            if evictable(key):
                victim = key
                del self._rank[key]
                break
            held.append(record)
        for record in held:
            heapq.heappush(self._heap, record)
        return victim

    def discard(self, key: bytes) -> None:
        super().discard(key)
        if key not in self._entries:
            self._rank.pop(key, None)

    def _compact(self) -> None:
        self._heap = [(uses, tick, key) for key, (uses, tick) in self._rank.items()]
        heapq.heapify(self._heap)


EVICTION_POLICIES: dict[str, type[SlotIndex]] = {"lru": SlotIndex, "lfu": LfuSlotIndex}
"""`eviction` option value -> the index that implements it."""


def check_eviction(text: str) -> str:
    """The policy named `text`; ValueError naming the choices otherwise."""
    if text not in EVICTION_POLICIES:
        raise ValueError(f"eviction must be one of {', '.join(EVICTION_POLICIES)}, got {text!r}")
    return text


def slot_index(policy: str, num_slots: int) -> SlotIndex:
    """An index of `num_slots` slots evicting by `policy` (`check_eviction` first)."""
    return EVICTION_POLICIES[check_eviction(policy)](num_slots)
