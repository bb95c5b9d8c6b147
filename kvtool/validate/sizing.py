"""Pool sizes for scenarios that squeeze the cache, computed from the model's layout."""

from __future__ import annotations

from kvtool.manager.layer_groups import LayerGroupSpec, plan_layer_groups
from kvtool.manager.pool_groups import pages_per_pool_group, plan_pool_groups
from kvtool.models import load_model
from kvtool.validate.harness import Context


def pages_per_block(ctx: Context) -> int:
    """Pages one block of the scenarios' short requests (ten blocks) takes in the busiest pool
    group: 1 for one full-attention group, 2 where two layer groups share a pool group, ..."""
    tpb = ctx.tokens_per_block
    groups = plan_layer_groups(load_model(ctx.model), tpb)
    per_pool = pages_per_pool_group(groups, plan_pool_groups(groups), 10 * tpb, tpb)
    return max(1, round(max(per_pool) / 10))


def squeeze_slots(ctx: Context, blocks: int) -> int:
    """Slots per pool group that hold `blocks` blocks of a request in this model's layout."""
    return blocks * pages_per_block(ctx)


def sliding_windows(ctx: Context) -> list[LayerGroupSpec]:
    """The layer groups of the model's layout at the context's block size that have a sliding window."""
    return [g for g in plan_layer_groups(load_model(ctx.model), ctx.tokens_per_block) if g.window_size is not None]
