"""The `torch` backend: `index_select` / `index_copy_` on strided views, one call pair per op.

It runs everywhere (CPU or CUDA tensors, any mix) and is the reference the other backends are
checked against.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtool.transfer.api import CopyOp


class TorchBackend:
    name = "torch"

    def __init__(self, priority: int | None = None) -> None:
        self.priority = priority

    def copy(self, ops: Sequence[CopyOp], stream: torch.cuda.Stream | None = None) -> None:
        self.launch(self.prepare(ops), stream)

    def prepare(self, ops: Sequence[CopyOp]) -> list[CopyOp]:
        return [op for op in ops if op.src_slots]

    def prepare_layers(self, layers: Sequence[Sequence[CopyOp]]) -> list[list[CopyOp]]:
        return [self.prepare(ops) for ops in layers]

    def launch(self, prepared: list[CopyOp], stream: torch.cuda.Stream | None = None) -> None:
        for op in prepared:
            src_index = torch.tensor(op.src_slots, dtype=torch.long, device=op.src.device)
            dst_index = torch.tensor(op.dst_slots, dtype=torch.long, device=op.dst.device)
            gathered = op.src.rows(op.src_offset, op.nbytes).index_select(0, src_index)
            gathered = gathered.to(op.dst.device, non_blocking=op.dst.device.type == "cuda")
            op.dst.rows(op.dst_offset, op.nbytes).index_copy_(0, dst_index, gathered)

    def synchronize(self, stream: torch.cuda.Stream | None = None) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            (stream or torch.cuda.current_stream()).synchronize()

    def join(self, stream: torch.cuda.Stream | None = None) -> None:
        """Nothing to join: every copy runs on the caller's stream."""
