"""The report of a replay over several engine instances: a row per instance and one for all."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
from rich.table import Table

from kvtool.report.run_folder import write_file, write_json, write_meta
from kvtool.units import format_seconds

COLUMNS = (("instance", "in-\nstance"), ("num_requests", "re-\nquests"), ("prompt_tokens", "prompt\ntokens"),
           ("local_hit_tokens", "local\nhits"), ("connector_hit_tokens", "connector\nhits"),
           ("hit_rate", "hit\nrate"), ("integrity_errors", "integrity\nerrors"), ("wall_seconds", "wall\ns"))


def instances_table(rows: list[dict[str, Any]], title: str) -> Table:
    """Counts of a million or more in millions (M), so that the table fits 80 columns."""
    table = Table(title=title)
    for _, header in COLUMNS:
        table.add_column(header, justify="right", no_wrap=True)
    for row in rows:
        cells = []
        for name, _ in COLUMNS:
            value = row[name]
            if name == "hit_rate":
                cells.append(f"{100 * value:.2f} %")
            elif isinstance(value, int):
                cells.append(f"{value / 1e6:.2f} M" if value >= 1_000_000 else f"{value:,}")
            elif isinstance(value, float):
                cells.append(f"{value:.1f}")
            else:
                cells.append(str(value))
        table.add_row(*cells, end_section=row["instance"] == rows[-2]["instance"] if len(rows) > 1 else False)
    return table


LATENCY_COLUMNS = (("instance", "instance"), ("ttft_p50_s", "TTFT p50"), ("ttft_p90_s", "TTFT p90"),
                   ("ttft_p99_s", "TTFT p99"), ("tpot_p50_s", "TPOT p50"), ("tpot_p99_s", "TPOT p99"),
                   ("load", "load"))


def latency_table(rows: list[dict[str, Any]], title: str) -> Table | None:
    """TTFT and TPOT percentiles per instance and over the fleet, and each instance's load (its
    prefill work over the fleet's mean; `all`: the busiest one's); None without a cost model."""
    if all(row.get("ttft_p50_s") is None for row in rows):
        return None
    table = Table(title=title)
    for _, header in LATENCY_COLUMNS:
        table.add_column(header, justify="right", no_wrap=True)
    for row in rows:
        load = row.get("load_ratio", row.get("load_imbalance"))
        cells = [str(row["instance"])] + [format_seconds(row.get(name)) for name, _ in LATENCY_COLUMNS[1:-1]]
        table.add_row(*cells, "-" if load is None else f"{load:.2f}x", end_section=row is rows[-2])
    return table


def write_instances_folder(folder: Path, rows: list[dict[str, Any]], total: dict[str, Any],
                           extra_meta: dict[str, Any]) -> None:
    """instances.csv/json (a row per instance, then `all`), summary.json (`all`), meta.json."""
    write_file(folder / "instances.csv", pd.DataFrame(rows + [total]).to_csv(index=False))
    write_json(folder / "instances.json", {"instances": rows, "all": total})
    write_json(folder / "summary.json", total)
    write_meta(folder, "trace-instances", **extra_meta)
