"""A tier's size against the GPU pool, said before a replay: a tier no larger than the pool serves
few or no hits (what it holds is still on the GPU, where a reuse counts as a local hit)."""

from __future__ import annotations

from kvtool.connector.loader import ConnectorSpec
from kvtool.connector.options import declared_options
from kvtool.engine.ranks import rank_manager_config
from kvtool.manager.manager import plan_num_slots
from kvtool.trace.setup import Replay, block_bytes
from kvtool.units import Capacity, parse_capacity, parse_size

TIER_CAPACITY_UNITS = {"index": "tokens or bytes", "stacked-index": "tokens or bytes", "host": "bytes",
                       "host-async": "bytes", "host-layerwise": "bytes"}
"""Connectors whose `capacity` is one engine's tier, and how a number without a unit reads there."""


def tier_tokens(replay: Replay) -> int | None:
    """Tokens the connector's own tier holds (its `capacity` in whole blocks of rank 0's shard);
    None for a connector whose size kvtool does not know."""
    units = TIER_CAPACITY_UNITS.get(replay.connector.name if replay.connector else "")
    if units is None:
        return None
    text = replay.options.get("capacity") or str(declared_default(replay.connector, "capacity"))
    capacity = parse_capacity(text) if units != "bytes" else Capacity(text, num_bytes=parse_size(text))
    manager = rank_manager_config(replay.config.manager, replay.config.tp_size, 0)
    return capacity.blocks(block_bytes(manager), manager.tokens_per_block) * manager.tokens_per_block


def pool_tokens(replay: Replay) -> int:
    """Tokens the GPU pool of rank 0 holds (its smallest pool group)."""
    manager = rank_manager_config(replay.config.manager, replay.config.tp_size, 0)
    return min(plan_num_slots(manager)) * manager.tokens_per_block


def tier_note(replay: Replay) -> str | None:
    """Why a tier no larger than the GPU pool serves (almost) nothing, said before the replay."""
    tier = tier_tokens(replay)
    pool = pool_tokens(replay)
    if tier is None or tier > pool or replay.config.scheduler.local_reuse is False:
        return None
    return (f"the {replay.connector.name if replay.connector else ''} tier holds {tier:,} tokens, no more than the GPU "
            f"pool's {pool:,}: what it holds is still on the GPU, where a reuse counts as a local hit, so expect few "
            "or no tier hits (a tier pays off above the pool's size; --no-local-reuse measures the tier alone)")


def declared_default(spec: ConnectorSpec | None, name: str) -> str | None:
    """The default a connector declares for its option `name` (None when it declares none)."""
    declared = declared_options(spec.scheduler_class) if spec else None
    return next((o.default for o in declared or () if o.name == name), None)
