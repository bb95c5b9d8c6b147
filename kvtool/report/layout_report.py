"""The layout as JSON, as CSV rows and as rich tables (what `kvtool inspect-layout` prints)."""

from __future__ import annotations

from typing import Any

import pandas as pd
from rich.console import Group
from rich.table import Table

from kvtool.manager.layout import KvCacheLayerGroupLayout, KvCacheLayout, KvCacheRegion
from kvtool.units import format_size


def layout_to_dict(layout: KvCacheLayout) -> dict[str, Any]:
    """The JSON document of the README's inspect-layout schema."""
    return {
        "model": layout.model_name,
        "tokens_per_block": layout.tokens_per_block,
        "dtype": layout.dtype_name,
        "virtual": layout.is_virtual,
        "layer_groups": [_group_dict(g) for g in layout.layer_groups],
        "pool_groups": [
            {"pool_group_index": pg.pool_group_index, "num_slots": pg.num_slots,
             "slot_bytes": pg.slot_bytes, "layer_group_ids": list(pg.layer_group_ids),
             "pools": [{"pool_index": p.pool_index, "base": p.base, "slot_bytes": p.slot_bytes} for p in pg.pools]}
            for pg in layout.pool_groups
        ],
        "total_bytes": total_bytes(layout),
    }


def _group_dict(group: KvCacheLayerGroupLayout) -> dict[str, Any]:
    return {
        "layer_group_id": group.layer_group_id,
        "layer_ids": list(group.layer_ids),
        "window_size": group.window_size,
        "num_sink_tokens": group.num_sink_tokens,
        "bytes_per_page": group.bytes_per_page,
        "pool_group_index": group.pool_group_index,
        "regions": [
            {"base": r.base, "size": r.size, "stride": r.stride, "num_slots": r.num_slots,
             "buffer_bytes": r.buffer_bytes,
             "buffers": [{"layer_id": b.layer_id, "role": b.role.value, "heads": _heads(spec)}
                         for b, spec in zip(r.buffers, r.buffer_specs, strict=True)]}
            for r in group.regions
        ],
    }


def _heads(spec) -> list[int]:
    """[first, end) of the model's global KV heads this buffer holds (a tensor-parallel shard)."""
    return [spec.first_head, spec.first_head + spec.num_heads]


def total_bytes(layout: KvCacheLayout) -> int:
    return sum(p.slot_bytes * pg.num_slots for pg in layout.pool_groups for p in pg.pools)


def layout_frame(layout: KvCacheLayout) -> pd.DataFrame:
    """One row per region."""
    rows = [
        {"layer_group_id": g.layer_group_id, "window_size": g.window_size, "pool_group_index": g.pool_group_index,
         "bytes_per_page": g.bytes_per_page, "region_index": i, "base": r.base, "size": r.size,
         "stride": r.stride, "num_slots": r.num_slots, "num_buffers": len(r.buffers),
         "buffer_bytes": r.buffer_bytes, "layers": compact_ids(g.layer_ids)}
        for g in layout.layer_groups for i, r in enumerate(g.regions)
    ]
    frame = pd.DataFrame(rows)
    frame["window_size"] = frame["window_size"].astype("Int64")
    return frame


def compact_ids(ids: tuple[int, ...] | list[int]) -> str:
    """`0-31` for runs, `0,2,4,…,22` for a longer stride, runs joined by commas otherwise."""
    ids = list(ids)
    if len(ids) > 3 and len({b - a for a, b in zip(ids, ids[1:], strict=False)}) == 1 and ids[1] - ids[0] > 1:
        return f"{ids[0]},{ids[1]},{ids[2]},…,{ids[-1]}"
    runs: list[str] = []
    start = prev = ids[0] if ids else 0
    for value in ids[1:] + [None]:  # type: ignore[list-item]
        if value is not None and value == prev + 1:
            prev = value
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if value is not None:
            start = prev = value
    return ",".join(runs if len(runs) <= 5 else runs[:4] + ["…", runs[-1]])


def _buffers_summary(region: KvCacheRegion) -> str:
    first, last = region.buffers[0], region.buffers[-1]
    spec = region.buffer_specs[0]
    heads = (f", heads {spec.first_head}–{spec.first_head + spec.num_heads - 1}"
             if spec.num_heads > 1 or spec.first_head else "")
    return (f"{len(region.buffers)} × {format_size(region.buffer_bytes)}{heads}: "
            f"{first.layer_id} {first.role.value} … {last.layer_id} {last.role.value}")


def layout_tables(layout: KvCacheLayout) -> Group:
    """Layer groups with their regions, pool groups, and totals."""
    groups = Table(title=f"{layout.model_name} · {layout.dtype_name} · {layout.tokens_per_block} tokens per block"
                         f"{' · virtual addresses' if layout.is_virtual else ''}")
    for column in ("group", "layers", "window", "bytes/page", "pool group", "region base", "size", "stride",
                   "slots", "buffers"):
        groups.add_column(column, overflow="fold")
    for g in layout.layer_groups:
        for i, r in enumerate(g.regions):
            head = [str(g.layer_group_id), compact_ids(g.layer_ids), str(g.window_size or "full"),
                    str(g.bytes_per_page), str(g.pool_group_index)] if i == 0 else [""] * 5
            groups.add_row(*head, hex(r.base), str(r.size), str(r.stride), str(r.num_slots), _buffers_summary(r))
    pools = Table(title="pool groups")
    for column in ("pool group", "layer groups", "slots", "slot bytes", "pools (index: base, slot bytes)", "bytes"):
        pools.add_column(column, overflow="fold")
    for pg in layout.pool_groups:
        pools.add_row(str(pg.pool_group_index), ",".join(map(str, pg.layer_group_ids)), str(pg.num_slots),
                      str(pg.slot_bytes), "; ".join(f"{p.pool_index}: {hex(p.base)}, {p.slot_bytes}" for p in pg.pools),
                      format_size(pg.slot_bytes * pg.num_slots))
    return Group(groups, pools, _totals_table(layout))


def _totals_table(layout: KvCacheLayout) -> Table:
    totals = Table(title=f"totals: {format_size(total_bytes(layout))} ({total_bytes(layout)} bytes)")
    for column in ("layer group", "pages", "tokens that fit", "shares slots with"):
        totals.add_column(column)
    for g in layout.layer_groups:
        pg = layout.pool_groups[g.pool_group_index]
        others = [str(x) for x in pg.layer_group_ids if x != g.layer_group_id]
        totals.add_row(str(g.layer_group_id), str(pg.num_slots), str(pg.num_slots * layout.tokens_per_block),
                       ",".join(others) or "-")
    return totals
