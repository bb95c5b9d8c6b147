"""What the fake engine's reads come to: the digest a sampled token is drawn from, and tensors moved
to a device in one copy (a wrong byte's coordinates, `IntegrityIssue`, is a pass type:
`engine/pass_types.py`)."""

from __future__ import annotations

import math

import numpy as np
import torch

CHECKSUM_MASK = (1 << 64) - 1


def digest(rows: torch.Tensor, positions: np.ndarray, attended: np.ndarray, layer_id: int) -> int:
    """Order-sensitive digest of the bytes the last position attends to, from `rows` (int64: each
    of `positions`' byte sum over the layer's buffers), over those of `positions` in `attended`: a
    block moved to another position changes it, as it would change a real model's output. A sum
    over the bytes modulo 2**64, so the digests of tensor-parallel shards add up to the whole model's."""
    if len(attended) != len(positions):   # a window slid during the pass: attended is a subset
        keep = np.isin(positions, attended)
        rows, positions = rows[torch.from_numpy(keep).to(rows.device)], positions[keep]
    weights = torch.from_numpy(positions * 2654435761 + 2 * layer_id + 1).to(rows.device)
    return int((rows * weights).sum()) & CHECKSUM_MASK


def moved(parts: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """`parts` (same first dimension) on `device`, in one copy side by side when they are elsewhere:
    on a GPU every copy is a synchronisation (`HOST_COMPARE_BYTES`)."""
    if parts[0].device == device:
        return parts
    rows = len(parts[0])
    moved = torch.cat([part.reshape(rows, -1) for part in parts], dim=1).to(device)
    widths = [math.prod(part.shape[1:]) for part in parts]
    return [piece.view(part.shape) for part, piece in zip(parts, torch.split(moved, widths, dim=1), strict=True)]
