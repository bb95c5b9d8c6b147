"""Tables at a narrow terminal (80 columns) cut nothing: no cell ellipsized, no line wider than the
console, a connector's whole name readable in its column, every shortened header in the legend."""

from __future__ import annotations

from rich.console import Console

from kvtool.cli.validate import _table
from kvtool.report.bench_report import _SHORT, column_legend, rows_tables
from kvtool.validate.results import CheckResult, Verdict

LONG = "dict_connector.py:DictConnectorScheduler:DictConnectorWorker"
ROW = {"connector": LONG, "direction": "save", "model": "llama-3.1-8b", "tokens_per_block": 16,
       "block_bytes": 2097152, "blocks": 16, "rounds": 1, "gbps": 0.311, "spread": None, "p50_us": 27274.8,
       "p99_us": 31175.5, "raw_gbps": 4.574, "ratio": 0.068, "vs_reference": 0.29, "verified": True}


def rendered(table, width=80) -> list[str]:
    with open("/dev/null", "w") as sink:
        console = Console(width=width, record=True, file=sink)
        console.print(table)
    return console.export_text().splitlines()


def column(lines: list[str], index: int) -> list[str]:
    """The text of column `index` on every body line of a rendered table."""
    return [line.split("│")[index + 1].strip() for line in lines if line.startswith("│")]


def test_a_bench_table_at_80_columns_keeps_every_name_and_value_whole():
    rows = [ROW, {**ROW, "connector": "host (kvtool reference, backend torch)", "direction": "load"}]
    tables = rows_tables(rows, f"kvtool bench --suite store · {LONG}", 80)
    assert len(tables) > 1                                   # it did not fit one: split, not squeezed
    seen_headers = set()
    for table in tables:
        lines = rendered(table)
        assert all(len(line) <= 80 for line in lines) and not [line for line in lines if "…" in line]
        assert LONG in "".join(column(lines, 0))             # folded onto lines, every character there
        seen_headers.update(c.header for c in table.columns)
        text = "\n".join(lines)
        assert "27274.8" in text or "p50 µs" not in {c.header for c in table.columns}
    assert seen_headers == {_SHORT.get(k, k) for k in ROW}   # every column shown, in one table or another
    legend = column_legend(list(ROW))
    for key in ("tokens_per_block", "block_bytes", "raw_gbps", "vs_reference", "spread", "verified"):
        assert f"{_SHORT[key]}: " in legend


def test_a_bench_table_that_fits_stays_one():
    (table,) = rows_tables([ROW], "t", 400)
    assert [c.header for c in table.columns] == [_SHORT.get(k, k) for k in ROW]


def test_the_validate_table_at_80_columns_cuts_no_name_and_keeps_the_evidence():
    evidence = "request 4 was admitted after the failure and failed only when it happened (connector failed)"
    results = [CheckResult("free-before-delivery", "tiny-vswa", "survives-hook-failure", Verdict.FAIL, 1.5, [evidence]),
               CheckResult("remote-flush", "tiny", "integrity", Verdict.SKIP, 0.0, ["needs --remote URL"])]
    lines = rendered(_table(results, LONG, all_rows=True, width=80))
    text = "\n".join(lines)
    assert all(len(line) <= 80 for line in lines) and "…" not in text
    for name in ("free-before-delivery", "tiny-vswa", "survives-hook-failure", "fail 1.50s", LONG):
        assert any(name in line for line in lines), name      # on one line, never folded
    assert " ".join(column(lines, 2)).split() == (evidence + " needs --remote URL").split()


def test_the_validate_table_at_140_columns_has_a_column_each():
    results = [CheckResult("cold-warm", "tiny", "integrity", Verdict.PASS, 0.5, ["ok"])]
    (header,) = [line for line in rendered(_table(results, "host", width=140), 140) if "scenario" in line]
    assert [h.strip() for h in header.split("┃")[1:-1]] == \
        ["scenario", "model / runtime", "check", "verdict", "time", "evidence"]
