"""kvtool bench on the CPU: output files and schema, verification, bad options; the manager suite."""

import json

import pandas as pd
import pytest
from typer.testing import CliRunner

from kvtool.bench.sweep import SweepChoice, plan
from kvtool.bench.workspace import Direction, geometry, make_workspace
from kvtool.cli import app
from kvtool.report.bench_report import ROW_KEYS
from tests.helpers.servers import RedisServer, need_redis

runner = CliRunner()


def test_quick_run_writes_every_output(tmp_path):
    result = runner.invoke(app, ["bench", "--quick", "--output", str(tmp_path), "--direction", "save",
                                 "--direction", "both", "--granularity", "layer", "--format", "json",
                                 "--backend", "torch"])
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "results.json").read_text())
    assert set(doc) >= {"device", "rows"} and len(doc["rows"]) == 2
    for row in doc["rows"]:
        assert set(ROW_KEYS) <= set(row)
        assert row["verified"] is True and row["gbps"] > 0 and row["peak_gbps"] > 0
        assert row["chunk_bytes"] == 16384 and row["ratio"] == pytest.approx(row["gbps"] / row["peak_gbps"], rel=1e-2)
    assert doc["rows"][1]["batch_bytes"] == 2 * doc["rows"][0]["batch_bytes"]   # both directions at once
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert set(meta) >= {"device", "commit", "command", "date"} and meta["device"]["kind"] in ("cpu", "cuda")
    assert len(pd.read_csv(tmp_path / "results.csv")) == 2
    assert (tmp_path / "gbps_vs_chunk.png").stat().st_size > 1000
    assert json.loads(result.stdout)[0]["backend"] == "torch"


def test_geometry_follows_the_layout():
    slot = geometry("llama-3.1-8b", 4, "slot")
    layer = geometry("llama-3.1-8b", 4, "layer")
    assert (slot.stride, slot.nbytes) == (4 * 131072, 4 * 131072)
    assert (layer.stride, layer.offset, layer.nbytes) == (4 * 131072, 0, 16384)
    assert geometry("deepseek-v3", 64, "layer").nbytes == 73728


def test_workspace_verification_catches_a_wrong_copy():
    import torch
    ws = make_workspace(geometry("tiny", 4, "slot"), 64 * 1024, torch.device("cpu"))
    (op,) = ws.ops(Direction.SAVE)
    ws.poison(Direction.SAVE)
    assert not ws.verify(Direction.SAVE)
    from kvtool.transfer import get_backend
    get_backend("torch").copy([op])
    assert ws.verify(Direction.SAVE)


def test_plan_uses_the_defaults_and_the_options():
    choice = SweepChoice(None, None, ("slot",), (Direction.SAVE,), ("torch",), None, None, quick=False)
    cases, repeats = plan(choice, cuda=False)
    assert repeats == 5 and {c.model for c in cases} == {"llama-3.1-8b", "gpt-oss-20b"}
    chosen = SweepChoice(("tiny",), (8, 16), ("layer",), (Direction.LOAD,), ("torch",), 1 << 20, 2, quick=False)
    cases, repeats = plan(chosen, cuda=True)
    assert [(c.model, c.tokens_per_block, c.batch_bytes) for c in cases] == \
        [("tiny", 8, 1 << 20), ("tiny", 16, 1 << 20)]
    assert repeats == 2


def test_manager_suite(tmp_path, monkeypatch):
    from kvtool.bench import manager_suite
    original = manager_suite.run
    monkeypatch.setattr(manager_suite, "run", lambda: original(base_blocks=64, scales=(1, 10), samples=2))
    result = runner.invoke(app, ["bench", "--suite", "manager", "--output", str(tmp_path)])
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert {r["operation"] for r in rows} == {"allocate (evicting)", "commit", "free", "match"}
    assert {r["cached_blocks"] for r in rows} == {64, 640}


@pytest.mark.parametrize("args, message", [
    (["--backend", "warp"], "unknown backend"),
    (["--direction", "sideways"], "unknown direction"),
    (["--granularity", "page"], "unknown granularity"),
    (["--model", "llama-9"], "unknown model"),
    (["--tokens-per-block", "0"], "tokens per block must be positive"),
    (["--repeats", "0"], "--repeats must be positive"),
    (["--batch-bytes", "lots"], "cannot read size"),
])
def test_bad_options_exit_2_with_one_line(args, message, tmp_path):
    result = runner.invoke(app, ["bench", "--output", str(tmp_path), *args])
    assert result.exit_code == 2 and message in result.stderr and "Traceback" not in result.output


@pytest.mark.parametrize("connector", ["host", "disk", "redis"])
def test_store_suite_round_trips_the_bytes_and_reports_the_ratio(tmp_path, connector):
    extra = []
    server = None
    if connector == "redis":
        need_redis()
        server = RedisServer().start()
        extra = ["--connector-opt", f"url={server.url}"]
    try:
        result = runner.invoke(app, ["bench", "--suite", "store", "--connector", connector, "--model", "tiny",
                                     "--tokens-per-block", "4", "--tokens-per-block", "8", "--batch-bytes", "64KiB",
                                     "--repeats", "2", "--format", "json", "--output", str(tmp_path), *extra])
        assert result.exit_code == 0, result.output
        rows = json.loads((tmp_path / "results.json").read_text())["rows"]
        assert [(r["direction"], r["tokens_per_block"]) for r in rows] == [("save", 4), ("load", 4), ("save", 8),
                                                                            ("load", 8)]
        for r in rows:
            assert r["verified"] and r["connector"] == connector
            assert r["batch_blocks"] == 65536 // r["block_bytes"]
            assert r["ratio"] == pytest.approx(r["gbps"] / r["raw_gbps"], rel=0.01)
            assert 0 < r["p50_us"] <= r["p99_us"]
        if server is not None:
            assert server.client().dbsize() == 0          # the bench deletes what it saved
    finally:
        if server is not None:
            server.stop()


def test_store_suite_refuses_a_store_it_has_no_raw_loop_for(tmp_path):
    result = runner.invoke(app, ["bench", "--suite", "store", "--connector", "index", "--output", str(tmp_path)])
    assert result.exit_code == 2 and "measures host" in result.output


def _plot_rows() -> list[dict]:
    """Two models x two granularities x two block sizes: each layout has chunk sizes of its own, and
    GB/s that fall with the chunk in one layout and rise in another (one line across them zig-zags)."""
    rows = []
    for model, granularity, chunk, slope in [("llama-3.1-8b", "slot", 1 << 19, 1),
                                             ("llama-3.1-8b", "layer", 1 << 14, -1),
                                             ("gpt-oss-20b", "slot", 3 << 16, 2),
                                             ("gpt-oss-20b", "layer", 1 << 13, -1)]:
        for direction in ("save", "load"):
            for tpb in (4, 16):
                for backend, scale in (("torch", 1.0), ("kernel", 10.0)):
                    rows.append({"backend": backend, "direction": direction, "granularity": granularity,
                                 "model": model, "tokens_per_block": tpb, "chunk_bytes": chunk * tpb // 4,
                                 "gbps": scale * (20 + slope * tpb), "peak_gbps": 500.0 + tpb})
    return rows


def test_the_plot_draws_a_line_per_backend_in_a_panel_per_model_granularity_and_direction():
    from kvtool.report.bench_plot import PEAK_LABEL, figure
    rows = _plot_rows()[:-4]          # gpt-oss-20b layer has no load rows
    fig = figure(rows, "cpu")
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == [f"{d} · {m} · {g}" for m, g in [("llama-3.1-8b", "slot"), ("llama-3.1-8b", "layer"),
                                                      ("gpt-oss-20b", "slot"), ("gpt-oss-20b", "layer")]
                      for d in ("save", "load")]
    colours = {}
    for ax in fig.axes[:-1]:
        direction, model, granularity = ax.get_title().split(" · ")
        lines = ax.get_lines()
        assert [line.get_label() for line in lines] == ["kernel", "torch", PEAK_LABEL]
        mine = [r for r in rows if (r["direction"], r["model"], r["granularity"]) == (direction, model, granularity)]
        for line in lines[:2]:
            points = sorted((r["chunk_bytes"], r["gbps"]) for r in mine if r["backend"] == line.get_label())
            assert list(zip(line.get_xdata(), line.get_ydata(), strict=True)) == points and len(points) == 2
            assert colours.setdefault(line.get_label(), line.get_color()) == line.get_color()
        peak = lines[2]
        assert peak.get_linestyle() == "--" and list(peak.get_ydata()) == [504.0, 516.0]
    assert not fig.axes[-1].get_lines() and fig.axes[-1].texts[0].get_text() == "not measured"
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["kernel", "torch", PEAK_LABEL]
    import matplotlib.pyplot as plt
    plt.close(fig)
