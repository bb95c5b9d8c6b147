"""`kvtool bench --suite store --with-compute`: products beside a connector's saves, classified by
the intervals the engine timed; the CLI's rows and failures."""

import json
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvtool.bench.compute_load import ComputeLoadError, MatmulLoad, Product, during, overlap
from kvtool.cli import app
from tests.test_bench_protocol import CONNECTOR, REFERENCE

runner = CliRunner()

SAVE_PAUSE_S = 0.03
SLOW = CONNECTOR + f'''

class SlowSavingWorker(Worker):
    """Each pass's saves take {SAVE_PAUSE_S} s longer: products surely run inside them."""
    def wait_for_save(self, stream):
        import time
        time.sleep({SAVE_PAUSE_S} if self._metadata["save"] else 0)
        super().wait_for_save(stream)


class CorruptingSaveWorker(Worker):
    """Saves zeros instead of the page."""
    def wait_for_save(self, stream):
        super().wait_for_save(stream)
        for key, _ in self._metadata["save"]:
            STORE[key] = STORE[key].clone().zero_()
'''
COMPUTE_COLUMNS = ["connector", "model", "tokens_per_block", "products", "matmul_ms_alone", "matmul_ms_during_saves",
                   "matmul_ms_engine_only", "slowdown_during_saves", "engine_slowdown", "products_during_saves",
                   "products_dropped",
                   "save_gbps_with_compute", "save_gbps", "save_ratio_with_compute", "verified"]


def test_overlap_is_the_covered_fraction():
    product = Product(10.0, 12.0)
    assert overlap(product, []) == 0.0
    assert overlap(product, [(0.0, 9.0), (12.0, 13.0)]) == 0.0
    assert overlap(product, [(9.0, 11.0)]) == 0.5
    assert overlap(product, [(10.5, 11.0), (11.5, 20.0)]) == 0.5
    assert overlap(product, [(0.0, 100.0)]) == 1.0


def test_during_keeps_products_inside_the_window_at_least_half_covered():
    products = [Product(0.0, 1.0), Product(1.0, 2.0), Product(2.0, 3.0), Product(3.0, 4.0), Product(4.0, 5.0),
                Product(5.0, 6.0)]
    spans = [(0.0, 0.9), (1.4, 2.0), (3.0, 3.2), (4.0, 4.9), (5.0, 6.0)]
    # [0, 1] starts before the window and [5, 6] ends after it, though both are covered; [1, 2] is
    # 0.6 covered, [4, 5] 0.9; [3, 4] only 0.2 and [2, 3] not at all
    assert during(products, spans, window=(0.5, 5.5)) == [Product(1.0, 2.0), Product(4.0, 5.0)]


def test_ms_engine_takes_the_whole_round_when_its_spans_hold_too_few_products():
    from kvtool.bench.protocol_compute import MIN_ENGINE_PRODUCTS, engine_products
    products = [Product(float(i), i + 0.9) for i in range(40)]
    window = (0.0, 40.0)
    assert engine_products(products, [(2.0, 5.0)], window) == products          # 3 inside: too few
    many = [(0.0, float(MIN_ENGINE_PRODUCTS))]
    assert engine_products(products, many, window) == products[:MIN_ENGINE_PRODUCTS]
    assert engine_products(products, [], (10.0, 20.0)) == products[10:20]


def test_the_cpu_load_records_back_to_back_products_until_stopped():
    load = MatmulLoad(torch.device("cpu"))
    before = time.perf_counter()
    products = load.run_for(0.05)
    after = time.perf_counter()
    assert products and load.describe() == "fp32 256³ on cpu"
    assert before <= products[0].start and products[-1].end <= after
    assert all(p.seconds > 0 for p in products)
    assert all(a.end <= b.start for a, b in zip(products, products[1:], strict=False))


def test_a_failing_product_is_raised_by_stop():
    load = MatmulLoad(torch.device("cpu"))
    load.b = torch.ones(3, 5)                          # shapes that cannot be multiplied
    load.start()
    with pytest.raises(ComputeLoadError, match="the products beside the connector failed: RuntimeError"):
        load.stop()
    load.start()
    assert load.stop(quiet=True) == []                 # the caller is failing already: its error wins


@pytest.fixture
def slow_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("c") / "dict_connector.py"
    path.write_text(SLOW)
    return path


def _compute(out: Path) -> list[dict]:
    return json.loads((out / "results.json").read_text())["compute"]


def test_saves_beside_products_get_a_row_per_connector(slow_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("r") / "run"
    result = runner.invoke(app, ["bench", "--suite", "store", "--model", "tiny", "--quick", "--with-compute",
                                 "--connector", f"{slow_file}:Sched:SlowSavingWorker", "--output", str(out)])
    assert result.exit_code == 0, result.stderr
    rows = _compute(out)
    assert [list(r) for r in rows] == [COMPUTE_COLUMNS] * 2
    assert [(r["connector"], r["model"], r["tokens_per_block"], r["products"], r["verified"]) for r in rows] == [
        ("dict_connector.py:Sched:SlowSavingWorker", "tiny", 16, "fp32 256³ on cpu", True),
        (REFERENCE, "tiny", 16, "fp32 256³ on cpu", True)]
    slow = rows[0]
    # the four requests share one pass (QUICK's per_pass), whose saves take at least SAVE_PAUSE_S
    assert slow["products_during_saves"] >= 1
    assert slow["matmul_ms_alone"] > 0 and slow["matmul_ms_during_saves"] > 0
    saving, engine = slow["matmul_ms_during_saves"], slow["matmul_ms_engine_only"]
    assert slow["slowdown_during_saves"] == pytest.approx(saving / engine - 1, abs=0.002)
    assert slow["engine_slowdown"] == pytest.approx(engine / slow["matmul_ms_alone"] - 1, abs=0.002)
    # the pause bounds the save's rate: one pass of four requests of four 8 KiB blocks takes SAVE_PAUSE_S
    assert 0 < slow["save_gbps_with_compute"] < 4 * 4 * 8192 / SAVE_PAUSE_S / 1e9 * 1.01
    assert slow["save_ratio_with_compute"] == pytest.approx(slow["save_gbps_with_compute"] / slow["save_gbps"],
                                                            rel=0.01)
    assert (out / "compute.csv").read_text().splitlines()[0] == ",".join(COMPUTE_COLUMNS)
    assert "saves beside fp32 256³ on cpu" in result.stdout


def test_wrong_bytes_saved_beside_products_fail_the_run(slow_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("r") / "run"
    result = runner.invoke(app, ["bench", "--suite", "store", "--model", "tiny", "--quick", "--with-compute",
                                 "--connector", f"{slow_file}:Sched:CorruptingSaveWorker", "--output", str(out)])
    assert result.exit_code == 1
    assert [r["verified"] for r in _compute(out)] == [False, True]
    assert ("dict_connector.py:Sched:CorruptingSaveWorker, 16 tokens per block, saved beside products: not "
            "verified: ") in result.stderr


def test_a_failure_beside_the_saves_keeps_the_rows_measured_before_it(slow_file, tmp_path_factory, monkeypatch):
    """The products fail on the reference's round: the connector's compute row, measured before,
    is written with every store row."""
    import kvtool.bench.compute_load as compute_load
    start, calls = compute_load.MatmulLoad.start, []

    def fails_on_the_seventh(self):                     # six starts measure one connector's block size
        calls.append(1)
        if len(calls) == 7:
            raise ComputeLoadError("the products beside the connector failed: RuntimeError: out of memory")
        start(self)
    monkeypatch.setattr(compute_load.MatmulLoad, "start", fails_on_the_seventh)
    out = tmp_path_factory.mktemp("r") / "run"
    result = runner.invoke(app, ["bench", "--suite", "store", "--model", "tiny", "--quick", "--with-compute",
                                 "--connector", f"{slow_file}:Sched:Worker", "--output", str(out)])
    assert result.exit_code == 1
    assert result.stderr.splitlines()[-1] == ("kvtool: error: with compute: the products beside the connector "
                                              "failed: RuntimeError: out of memory")
    results = json.loads((out / "results.json").read_text())
    assert len(results["rows"]) == 4
    assert [r["connector"] for r in results["compute"]] == ["dict_connector.py:Sched:Worker"]
