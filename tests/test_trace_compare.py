"""`kvtool trace compare`: deltas of two run folders, exit 1 past --max-regression."""

import json

import pytest
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.report.trace_compare import Delta

runner = CliRunner()


def run_folder(tmp_path, name, **summary):
    folder = tmp_path / name
    folder.mkdir()
    ttft = {"with_connector": {"p50": summary.pop("p50", 1.0), "p99": 2.0}, "prefill_compute_saved_s": 3.0}
    document = {"hit_rate": 0.5, "computed_tokens": 1000, "local_hit_tokens": 10, **summary, "ttft": ttft}
    (folder / "summary.json").write_text(json.dumps(document))
    return str(folder)


def compare(*args):
    return runner.invoke(app, ["trace", "compare", *args])


def test_deltas_are_relative_to_a_and_signed_by_what_is_better():
    assert Delta("", "hit_rate", 0.5, 0.4).regression == pytest.approx(0.2)
    assert Delta("", "hit_rate", 0.5, 0.6).regression == 0
    assert Delta("", "ttft_p50_s", 1.0, 1.25).regression == pytest.approx(0.25)
    assert Delta("", "computed_tokens", 0, 5).regression == float("inf")
    assert Delta("", "computed_tokens", 0, 0).regression == 0 and Delta("", "x", None, 1).change is None


def test_a_regression_past_the_limit_exits_1_naming_it(tmp_path):
    a, b = run_folder(tmp_path, "a"), run_folder(tmp_path, "b", hit_rate=0.45, p50=1.02)
    result = compare(a, b, "--max-regression", "0.05")
    assert result.exit_code == 1
    assert "hit_rate regressed 10.00 % (limit 5.00 %)" in result.stderr and "ttft" not in result.stderr
    assert compare(a, b, "--max-regression", "0.1").exit_code == 0
    assert compare(a, b).exit_code == 0                          # no limit: only the table
    judged = compare(a, b, "--max-regression", "0.01", "--metric", "ttft_p50_s")
    assert judged.exit_code == 1 and "ttft_p50_s regressed 2.00 %" in judged.stderr


def test_json_lists_every_metric_of_both(tmp_path):
    a, b = run_folder(tmp_path, "a"), run_folder(tmp_path, "b", computed_tokens=1100)
    rows = json.loads(compare(a, b, "--format", "json").stdout)
    by_metric = {r["metric"]: r for r in rows}
    assert by_metric["computed_tokens"]["change"] == pytest.approx(0.1) and by_metric["computed_tokens"]["judged"]
    assert by_metric["ttft_p99_s"]["a"] == 2.0 and by_metric["prefill_compute_saved_s"]["b"] == 3.0


def test_two_sweeps_compare_point_by_point(tmp_path):
    for name, rate in (("a", 0.3), ("b", 0.2)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "sweep.json").write_text(json.dumps({"rows": [
            {"capacity_tokens": 1000, "tokens_per_block": 32, "hit_rate": 0.1},
            {"capacity_tokens": 10**6, "tokens_per_block": 32, "hit_rate": rate}]}))
    result = compare(str(tmp_path / "a"), str(tmp_path / "b"), "--max-regression", "0.2")
    assert result.exit_code == 1 and "hit_rate (capacity 1e+06, 32 tokens/block) regressed 33.33 %" in result.stderr


@pytest.mark.parametrize("b_kind, args, message", [
    ("none", [], "holds neither summary.json"),
    ("sweep", [], "is a trace run folder and"),
    ("run", ["--max-regression", "-1"], "--max-regression must be a fraction >= 0"),
    ("run", ["--metric", "speed"], "unknown metric 'speed'"),
])
def test_bad_input_exits_2(tmp_path, b_kind, args, message):
    a = run_folder(tmp_path, "a")
    b = tmp_path / "b"
    if b_kind == "run":
        b = run_folder(tmp_path, "b")
    else:
        b.mkdir()
        if b_kind == "sweep":
            (b / "sweep.json").write_text('{"rows": []}')
    result = compare(a, str(b), *args)
    assert result.exit_code == 2 and message in result.stderr and "Traceback" not in result.output
