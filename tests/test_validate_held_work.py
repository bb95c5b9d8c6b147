"""`kvtool validate` with a connector's background work held to the latest point the contract
allows (the default seed): a load that reads state bound after it started fails every run, with
evidence naming the late work; correct asynchronous connectors (pool, a thread per copy with a wait
kvtool cannot see, every copy 5 ms slower) pass."""

from __future__ import annotations

import pytest

from kvtool.connectors.registry import load_connector
from kvtool.engine.runtimes import RuntimeName
from kvtool.validate.harness import Context
from kvtool.validate.runner import run_scenario

LATE = "tests/helpers/late_connectors.py"
SCENARIOS = ("local-prefix", "async-save")


def _run(target: str, scenario: str):
    return run_scenario(scenario, Context(load_connector(target), "tiny", runtime=RuntimeName("trtllm-v2-release")))


def test_a_load_that_reads_the_metadata_bound_when_it_runs_fails_every_run_naming_the_late_work():
    verdicts = []
    for _ in range(3):
        results = _run(f"{LATE}:LateReader:LateReaderWorker", "local-prefix")
        (integrity,) = [r for r in results if r.check == "integrity"]
        verdicts.append(integrity.verdict.value)
        assert integrity.evidence[0] == (
            "request 5's load never wrote its pages: the background work start_load_kv started for it in iteration "
            "10 ran in iteration 11 (held by kvtool to the latest point the contract allows), after the next "
            "pass's metadata was bound. A background load must copy what it was handed when it started (the "
            "metadata of its own pass), not the connector's state when it runs"), integrity.evidence
    assert verdicts == ["fail"] * 3


@pytest.mark.parametrize("worker", ["PoolAsync:PoolAsyncWorker", "SlowPoolAsync:SlowPoolAsyncWorker",
                                    "BlocksInGetFinished:ThreadWaitWorker"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_correct_asynchronous_connector_passes_with_its_work_held(worker, scenario):
    results = _run(f"{LATE}:{worker}", scenario)
    assert [(r.check, r.evidence[:2]) for r in results if r.failed] == []
    assert any(r.check == "integrity" and r.verdict.value == "pass" for r in results)
