"""What a capacity sweep replays: its points (no tier, then each capacity a GPU, per tokens per
block), a capacity turned into the whole blocks of a GPU's shard it holds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvtool.engine.ranks import rank_manager_config
from kvtool.trace.setup import ReplayOptions, block_bytes, build_replay
from kvtool.types import Fidelity
from kvtool.units import Capacity


@dataclass(frozen=True)
class SweepPoint:
    capacity_tokens: int | None
    """None: the connector's own size (one kvtool cannot set); 0: no tier (the baseline)."""
    tokens_per_block: int
    capacity_bytes: int | None = None
    """What the tier's whole blocks take (a GPU's shard), for tables and plots in GiB."""
    ttft_slo: float | None = None
    """The sweep's TTFT objective: the point's row says the share of requests within it."""


def shard_block_bytes(options: ReplayOptions, fidelity: Fidelity, tokens_per_block: int) -> int:
    """Bytes of one block of a GPU's shard (rank 0's), every layer group: what a tier's size holds."""
    replay = build_replay(replace(options, tokens_per_block=tokens_per_block, fidelity=fidelity, connector="none",
                                  connector_opt=(), connector_dir=None))
    return block_bytes(rank_manager_config(replay.config.manager, replay.config.tp_size, 0))


def sweep_points(options: ReplayOptions, fidelity: Fidelity, capacities: Sequence[Capacity | None], tpbs: list[int],
                 baseline: bool) -> list[SweepPoint]:
    """The points, by tokens per block: the no-tier one first (with `baseline`), then each capacity
    from the smallest (a size as the tokens of the whole blocks it holds; equal ones once)."""
    points = []
    for tpb in tpbs:
        if baseline:
            points.append(SweepPoint(0, tpb, 0))
        if capacities == [None]:
            points.append(SweepPoint(None, tpb))
            continue
        per_block = shard_block_bytes(options, fidelity, tpb)
        sized: dict[int, SweepPoint] = {}
        for c in capacities:
            assert c is not None
            blocks = c.blocks(per_block, tpb)
            tokens = c.tokens if c.tokens is not None else blocks * tpb
            sized.setdefault(tokens, SweepPoint(tokens, tpb, blocks * per_block))
        points += [sized[t] for t in sorted(sized)]
    return points
