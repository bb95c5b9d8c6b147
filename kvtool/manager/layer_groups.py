"""Layer groups (life cycles) and their coalesced buffers.

Layers that share attention kind, window size and sink count form one layer group, numbered in
order of first appearance. Inside a group, buffers of equal size are concatenated in layer order
(layer 0 key, layer 0 value, layer 1 key, ...) into one coalesced buffer; the group's slot-size
list is the coalesced sizes, largest first (one pool each).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kvtool.blocks import num_live_blocks, num_sink_blocks, stale_block_range
from kvtool.models import BufferSpec, ModelSpec
from kvtool.types import LayerGroupId, LayerId, Role


class BufferId(NamedTuple):
    layer_id: LayerId
    role: Role


@dataclass(frozen=True)
class CoalescedBuffer:
    """Equal-size buffers of one layer group, back to back in layer order."""

    buffer_bytes: int
    buffer_ids: tuple[BufferId, ...]
    specs: tuple[BufferSpec, ...]

    @property
    def size(self) -> int:
        return self.buffer_bytes * len(self.buffer_ids)


@dataclass(frozen=True)
class LayerGroupSpec:
    layer_group_id: LayerGroupId
    layer_ids: tuple[LayerId, ...]
    window_size: int | None
    num_sink_tokens: int
    coalesced: tuple[CoalescedBuffer, ...]
    """One per pool, largest first."""

    @property
    def slot_sizes(self) -> tuple[int, ...]:
        return tuple(c.size for c in self.coalesced)

    @property
    def bytes_per_page(self) -> int:
        return sum(self.slot_sizes)

    def num_sink_blocks(self, tokens_per_block: int) -> int:
        return num_sink_blocks(self.num_sink_tokens, tokens_per_block)

    def stale_range(self, history_length: int, tokens_per_block: int) -> range:
        """Blocks that no later token attends to at this history (`kvtool.blocks.stale_block_range`)."""
        return stale_block_range(history_length, tokens_per_block, self.window_size, self.num_sink_tokens)

    def num_live_blocks(self, num_tokens: int, tokens_per_block: int) -> int:
        """Pages a sequence of `num_tokens` holds in this group (stale blocks need none)."""
        return num_live_blocks(num_tokens, tokens_per_block, self.window_size, self.num_sink_tokens)


def plan_layer_groups(model: ModelSpec, tokens_per_block: int) -> tuple[LayerGroupSpec, ...]:
    """Group the model's layers into layer groups and coalesce their buffers."""
    keys: list[tuple[int | None, int]] = []
    members: dict[tuple[int | None, int], list] = {}
    for layer in model.layers:
        key = (layer.window_size, layer.num_sink_tokens)
        if key not in members:
            keys.append(key)
            members[key] = []
        members[key].append(layer)
    return tuple(
        LayerGroupSpec(LayerGroupId(i), tuple(layer.layer_id for layer in members[key]), key[0], key[1],
                       _coalesce(model, members[key], tokens_per_block))
        for i, key in enumerate(keys)
    )


def _coalesce(model: ModelSpec, layers: list, tokens_per_block: int) -> tuple[CoalescedBuffer, ...]:
    by_size: dict[int, list[tuple[BufferId, BufferSpec]]] = {}
    for layer in layers:
        for spec in layer.buffers:
            size = model.buffer_bytes(spec, tokens_per_block)
            by_size.setdefault(size, []).append((BufferId(layer.layer_id, spec.role), spec))
    return tuple(
        CoalescedBuffer(size, tuple(b for b, _ in entries), tuple(s for _, s in entries))
        for size, entries in sorted(by_size.items(), key=lambda kv: -kv[0])
    )
