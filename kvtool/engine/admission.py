"""Admission that guarantees the running requests can finish (TensorRT-LLM's GUARANTEED_NO_EVICT).

Greedy admission lets a new request in whenever its first chunk gets pages; on a long workload the
pool then fills with requests that all still grow (more prefill chunks, generated tokens) and none
can go on. With output reservation a new request is admitted only if, after its own first chunk,
every pool group still has pages available (free or evictable) for what each running request and
the new one will grow to: prompt plus `max_new_tokens`. Growth counts the pages each layer group
holds at a length (`num_live_blocks`), so a sliding-window group reserves only up to its window.
"""

from __future__ import annotations

from kvtool.engine.request_state import RequestState
from kvtool.manager.manager import KvCacheManager
from kvtool.types import PoolGroupIndex


class OutputReservation:
    """The pages the admitted requests may still need, per pool group, for one scheduling pass."""

    def __init__(self, manager: KvCacheManager) -> None:
        self._manager = manager
        self._groups = [(g, manager.page_table.pool_group_of(g.layer_group_id)) for g in manager.layer_groups]
        self._reserved = [0] * len(manager.num_slots)

    def start_pass(self, running: list[RequestState]) -> None:
        """Reset to the growth still owed to the requests already running."""
        self._reserved = [0] * len(self._reserved)
        for state in running:
            self._add(self._growth(state))

    def admit(self, state: RequestState, alone: bool) -> bool:
        """Whether `state`, whose first chunk already holds its pages, may run: True and reserved
        when its growth fits beside the others' (or it would run alone), else False."""
        growth = self._growth(state)
        table = self._manager.page_table
        fits = all(table.num_available(PoolGroupIndex(pg)) >= reserved + need
                   for pg, (reserved, need) in enumerate(zip(self._reserved, growth, strict=True)))
        if fits or alone:
            self._add(growth)
        return fits or alone

    def _growth(self, state: RequestState) -> list[int]:
        tpb = self._manager.tokens_per_block
        final = state.prompt_len + state.request.max_new_tokens
        now = state.held_kv.capacity
        growth = [0] * len(self._reserved)
        for group, pg in self._groups:
            growth[pg] += max(group.num_live_blocks(final, tpb) - group.num_live_blocks(now, tpb), 0)
        return growth

    def _add(self, growth: list[int]) -> None:
        self._reserved = [r + g for r, g in zip(self._reserved, growth, strict=True)]
