"""kvtool's fingerprints in vLLM's KV cache tensors: written where a forward pass writes a token's
key and value, checked wherever attention reads one.

vLLM hands a worker one tensor per attention layer, `[num_blocks, num_kv_heads, block_size, C]` in
the layer's dtype (any stride order, last dimension contiguous), `C` = the key's head then the
value's. A token at position p of a request lives in block `blocks[p // block_size]`, row
`p % block_size`. Its bytes are `fingerprint.expected_bytes` of the request's prefix hash at p, the
layer and the role (`Role.KEY` in the first half of C, `Role.VALUE` in the second), so a block in
the wrong slot, a swapped layer, head or role, or a block never written reads back as a mismatch
with its coordinates. Free blocks are poisoned (`POISON`) so that a load that never happened cannot
pass on bytes a block kept from an earlier use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtool.engine.fingerprint import expected_bytes
from kvtool.models import ModelSpec
from kvtool.types import Role
from kvtool.vllm_compat.model_config import layer_name

POISON = 0xA5
"""The byte every free block holds: bytes nobody wrote since the block was freed."""

MAX_ISSUES = 20
"""Issues kept per check (the count is exact; the first ones are described)."""

NULL_BLOCK = 0
"""vLLM's null block: a sliding-window group's place holder for a block outside the window."""


@dataclass(frozen=True)
class ByteIssue:
    """One token's bytes of one layer that differ from what a full recompute writes."""

    request_id: str
    layer: str
    position: int
    block_id: int
    what: str
    """"mismatch", "never written (poison)", or "no block (the null block)"."""
    worker: int = 0

    def describe(self) -> str:
        where = f"worker {self.worker}, " if self.worker else ""
        return (f"{where}request {self.request_id}, {self.layer}, position {self.position} "
                f"(block {self.block_id}): {self.what}")


@dataclass(frozen=True)
class LayerGeometry:
    """One worker's share of a layer: its heads and the bytes of one head of one role."""

    layer_id: int
    num_heads: int
    first_head: int
    head_bytes: int


def layer_geometry(spec: ModelSpec) -> dict[str, LayerGeometry]:
    """Each attention layer of a worker's (shard of the) model, by vLLM's layer name."""
    return {layer_name(layer.layer_id): LayerGeometry(int(layer.layer_id), layer.buffers[0].num_heads,
                                                       layer.buffers[0].first_head,
                                                       layer.buffers[0].head_bytes(spec.dtype))
            for layer in spec.layers}


class FingerprintPages:
    """One worker's KV cache tensors, written and checked as the fake forward needs."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], geometry: Mapping[str, LayerGeometry],
                 block_size: int, worker: int = 0) -> None:
        self._bytes = {name: t.view(torch.uint8) for name, t in tensors.items()}
        self._geometry = dict(geometry)
        self._block_size = block_size
        self._worker = worker

    def poison(self, block_ids: Sequence[int]) -> None:
        """Fill these blocks of every layer with POISON."""
        if not block_ids:
            return
        index = torch.as_tensor(list(block_ids), dtype=torch.long)
        for view in self._bytes.values():
            view[index] = POISON

    def write(self, layer: str, blocks: Sequence[int], hashes: np.ndarray, start: int, end: int) -> None:
        """Positions [start, end) of a request whose prefix hashes are `hashes`, into its `blocks`
        (positions in the null block are skipped: a sliding window's stale blocks)."""
        positions = [p for p in range(start, end) if blocks[p // self._block_size] != NULL_BLOCK]
        if not positions:
            return
        block_index, rows = self._coordinates(blocks, positions)
        self._bytes[layer][block_index, :, rows, :] = torch.from_numpy(self._expected(layer, hashes, positions))

    def check(self, request_id: str, layer: str, blocks: Sequence[int], hashes: np.ndarray,
              positions: Sequence[int]) -> tuple[int, list[ByteIssue]]:
        """How many of `positions` differ from their fingerprints in this layer, and the first ones."""
        if not positions:
            return 0, []
        null = [p for p in positions if blocks[p // self._block_size] == NULL_BLOCK]
        real = [p for p in positions if blocks[p // self._block_size] != NULL_BLOCK]
        issues = [self._issue(request_id, layer, p, NULL_BLOCK, "no block (the null block)") for p in null]
        if not real:
            return len(issues), issues[:MAX_ISSUES]
        block_index, rows = self._coordinates(blocks, real)
        found = self._bytes[layer][block_index, :, rows, :].numpy()
        wrong = np.flatnonzero((found != self._expected(layer, hashes, real)).reshape(len(real), -1).any(axis=1))
        for i in wrong[:MAX_ISSUES]:
            what = "never written (poison)" if (found[i] == POISON).all() else "mismatch"
            issues.append(self._issue(request_id, layer, real[i], int(block_index[i]), what))
        return len(null) + len(wrong), issues[:MAX_ISSUES]

    def _coordinates(self, blocks: Sequence[int], positions: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        pos = np.asarray(positions, dtype=np.int64)
        block_index = np.asarray(blocks, dtype=np.int64)[pos // self._block_size]
        return torch.from_numpy(block_index), torch.from_numpy(pos % self._block_size)

    def _expected(self, layer: str, hashes: np.ndarray, positions: Sequence[int]) -> np.ndarray:
        g = self._geometry[layer]
        chosen = hashes[np.asarray(positions, dtype=np.int64)]
        key = expected_bytes(chosen, g.layer_id, Role.KEY, g.num_heads, g.head_bytes, g.first_head)
        value = expected_bytes(chosen, g.layer_id, Role.VALUE, g.num_heads, g.head_bytes, g.first_head)
        return np.ascontiguousarray(np.concatenate([key, value], axis=2))

    def _issue(self, request_id: str, layer: str, position: int, block_id: int, what: str) -> ByteIssue:
        return ByteIssue(request_id, layer, position, block_id, what, self._worker)
