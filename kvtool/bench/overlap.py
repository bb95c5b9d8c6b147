"""`--suite store --with-compute`: the link share and the compute slowdown side by side.

One row per (connector, tokens per block): the save and load GB/s over the link (or contiguous
copy) measured in the same run (`ProtocolRow.ratio`), and how much slower the products ran inside
the connector's saves than beside the engine alone (`ComputeRow.slowdown_during_saves`). The mode
is the connector's `mode` option (kvtool's block stores: `sync`, `async`, `layerwise`; the
overlapping modes are the last two), or what it declares as its default; empty for a connector
that has none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from kvtool.connector.loader import ConnectorSpec

OVERLAPPING_MODES = ("async", "layerwise")


@dataclass(frozen=True)
class OverlapRow:
    connector: str
    mode: str
    tokens_per_block: int
    block_bytes: int
    save_link_share: float
    load_link_share: float
    compute_slowdown: float | None
    """Products inside the saves against beside the engine alone, - 1 (None: none ran inside)."""
    verified: bool

    def as_dict(self) -> dict:
        return asdict(self)


def connector_mode(spec: ConnectorSpec, options: Mapping[str, str]) -> str:
    """The `mode` the connector runs in: given, else its spec's, else the default it declares."""
    given = {**spec.options, **options}.get("mode")
    if given:
        return given
    declared = {o.name: o.default for o in getattr(spec.scheduler_class, "kvtool_options", ())}
    return declared.get("mode") or ""


def overlap_rows(store_rows: Sequence[Mapping], compute_rows: Sequence[Mapping],
                 modes: Mapping[str, str]) -> list[OverlapRow]:
    """A row per (connector, tokens per block) of `store_rows` that `compute_rows` also has, in
    the store rows' order; `modes`: connector label -> mode."""
    slowdown = {(r["connector"], r["tokens_per_block"]): r for r in compute_rows}
    shares: dict[tuple[str, int], dict[str, Mapping]] = {}
    for row in store_rows:
        shares.setdefault((row["connector"], row["tokens_per_block"]), {})[row["direction"]] = row
    out = []
    for (label, tpb), by_direction in shares.items():
        compute = slowdown.get((label, tpb))
        if compute is None or not {"save", "load"} <= set(by_direction):
            continue
        save, load = by_direction["save"], by_direction["load"]
        out.append(OverlapRow(label, modes.get(label, ""), tpb, save["block_bytes"], save["ratio"], load["ratio"],
                              compute["slowdown_during_saves"],
                              bool(save["verified"] and load["verified"] and compute["verified"])))
    return out
