"""On GPU pages (`--device cuda`), the planted early-report bug fails every run at the default
seed and on 20 seeds, with one verdict set per seed; its correct twin passes. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from kvtool.connector.loader import ConnectorSpec
from kvtool.validate.harness import Context
from kvtool.validate.runner import run_scenario
from tests.helpers.early_report_connectors import EarlyReport, EarlyReportWorker, ReportsLanded

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

MODULE = "tests.helpers.early_report_connectors"
EARLY = ConnectorSpec("early-report", EarlyReport, EarlyReportWorker, MODULE)


def _verdicts(spec: ConnectorSpec, seed: int = 0) -> frozenset:
    return frozenset((r.check, r.verdict.value) for r in run_scenario("async-save", Context(spec, "tiny", seed=seed,
                                                                                             device="cuda")))


def test_an_early_report_fails_every_run_at_the_default_seed_on_gpu_pages():
    runs = {_verdicts(EARLY) for _ in range(20)}
    assert runs == {frozenset({("load-completes", "pass"), ("finished-ids", "pass"), ("integrity", "fail")})}


def test_an_early_report_fails_on_every_seed_on_gpu_pages():
    assert [s for s in range(20) if ("integrity", "fail") in _verdicts(EARLY, s)] == list(range(20))


def test_its_correct_twin_passes_on_gpu_pages():
    assert {v for _, v in _verdicts(ConnectorSpec("host-async", EarlyReport, ReportsLanded, MODULE))} == {"pass"}
