"""`bench --suite store --with-compute`: the link share and the compute slowdown side by side,
and `--plot`'s overlap.png (issue 56 item 5)."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtool.bench.overlap import OverlapRow, connector_mode, overlap_rows
from kvtool.cli import app
from kvtool.connectors.registry import BUILTIN_CONNECTORS
from kvtool.report.overlap_plot import overlap_figure

runner = CliRunner()
OVERLAP_COLUMNS = ["connector", "mode", "tokens_per_block", "block_bytes", "save_link_share", "load_link_share",
                   "compute_slowdown", "verified"]


def store_row(connector, direction, tpb, ratio, verified=True):
    return {"connector": connector, "direction": direction, "tokens_per_block": tpb, "block_bytes": tpb * 65536,
            "ratio": ratio, "verified": verified}


def compute_row(connector, tpb, slowdown, verified=True):
    return {"connector": connector, "tokens_per_block": tpb, "slowdown_during_saves": slowdown, "verified": verified}


def test_a_row_per_connector_and_block_size_holds_both_shares_and_the_slowdown():
    store = [store_row("a", "save", 16, 0.91), store_row("a", "load", 16, 0.95), store_row("a", "save", 32, 0.93),
             store_row("a", "load", 32, 0.97, verified=False), store_row("ref", "save", 16, 0.88),
             store_row("ref", "load", 16, 0.86)]
    compute = [compute_row("a", 16, 0.012), compute_row("a", 32, None), compute_row("ref", 16, 0.03)]
    rows = overlap_rows(store, compute, {"a": "layerwise", "ref": "sync"})
    assert rows == [OverlapRow("a", "layerwise", 16, 16 * 65536, 0.91, 0.95, 0.012, True),
                    OverlapRow("a", "layerwise", 32, 32 * 65536, 0.93, 0.97, None, False),
                    OverlapRow("ref", "sync", 16, 16 * 65536, 0.88, 0.86, 0.03, True)]
    assert list(rows[0].as_dict()) == OVERLAP_COLUMNS


def test_a_block_size_without_a_compute_row_gets_no_overlap_row():
    assert overlap_rows([store_row("a", "save", 16, 0.9), store_row("a", "load", 16, 0.9)], [], {}) == []


def test_the_mode_is_the_option_given_else_the_spec_s_else_the_declared_default():
    assert connector_mode(BUILTIN_CONNECTORS["host"], {"mode": "async"}) == "async"
    assert connector_mode(BUILTIN_CONNECTORS["host-layerwise"], {}) == "layerwise"
    assert connector_mode(BUILTIN_CONNECTORS["host"], {}) == "sync"


def test_the_figure_draws_each_share_and_the_slowdown_against_block_size():
    rows = [OverlapRow("a", "layerwise", tpb, tpb * 65536, share, share + 0.01, slow, True).as_dict()
            for tpb, share, slow in ((16, 0.9, 0.01), (32, 0.95, 0.02))]
    fig = overlap_figure(rows, "cpu")
    share, slow = fig.axes
    lines = {line.get_label(): line for line in share.get_lines() + slow.get_lines()}
    assert list(lines["a (layerwise) save"].get_xdata()) == [1.0, 2.0]           # MiB a block
    assert list(lines["a (layerwise) save"].get_ydata()) == [0.9, 0.95]
    assert list(lines["a (layerwise) load"].get_ydata()) == [0.91, 0.96]
    assert list(lines["a (layerwise)"].get_ydata()) == pytest.approx([1.0, 2.0])  # percent


@pytest.fixture(scope="module")
def plotted(tmp_path_factory) -> tuple[Path, object]:
    out = tmp_path_factory.mktemp("r") / "run"
    result = runner.invoke(app, ["bench", "--suite", "store", "--model", "tiny", "--quick", "--with-compute",
                                 "--connector", "host", "--connector-opt", "mode=layerwise", "--plot",
                                 "--output", str(out)])
    return out, result


def test_plot_writes_overlap_png_and_the_side_by_side_rows(plotted):
    out, result = plotted
    assert result.exit_code == 0, result.stderr
    rows = json.loads((out / "results.json").read_text())["overlap"]
    assert [list(r) for r in rows] == [OVERLAP_COLUMNS] * 2
    assert [(r["connector"], r["mode"], r["tokens_per_block"], r["verified"]) for r in rows] == [
        ("host", "layerwise", 16, True), ("host (kvtool reference, backend torch)", "sync", 16, True)]
    store = json.loads((out / "results.json").read_text())["rows"]
    ratios = {(r["connector"], r["direction"]): r["ratio"] for r in store}
    assert rows[0]["save_link_share"] == ratios["host", "save"] and rows[0]["load_link_share"] == ratios["host", "load"]
    assert (out / "overlap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "overlap.csv").read_text().splitlines()[0] == ",".join(OVERLAP_COLUMNS)
    assert "link share and compute slowdown side by side" in result.stdout


def test_plot_without_with_compute_is_an_input_error(tmp_path):
    result = runner.invoke(app, ["bench", "--suite", "store", "--connector", "host", "--plot",
                                 "--output", str(tmp_path / "r")])
    assert result.exit_code == 2 and "--plot" in result.stderr and "--with-compute" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
