"""Issue 27's GPU false alarm, made certain on any machine: host-async whose background saves land
a second late. A repeated prompt asked while its save is still in flight is offered
nothing; that is legal (a miss), never a failure, and --strict still catches it."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvtool.cli import app

runner = CliRunner()
TARGET = "tests/helpers/slow_async_host.py:SlowSaves:SlowSavingWorker"


def _validate(*extra: str):
    return runner.invoke(app, ["validate", TARGET, "--connector-opt", "mode=async", "--model", "tiny",
                               "--scenario", "local-prefix", "--runtime", "trtllm-v2-release", "--format", "json",
                               *extra])


def test_a_repeat_asked_while_its_save_is_in_flight_is_a_miss_not_a_failure():
    result = _validate()
    assert result.exit_code == 0, result.output
    assert "4 checks under trtllm-v2-release: 3 passed, 1 missed" in result.stderr
    rows = json.loads(result.stdout)["results"]
    (hit,) = [r for r in rows if r["check"] == "warm-hit"]
    assert hit["verdict"] == "miss"
    assert "repeats a prompt the connector saw, but it offered nothing" in hit["evidence"][0]
    assert [r["check"] for r in rows if r["verdict"] == "pass"] == ["registration", "integrity", "finished-ids"]


def test_strict_turns_the_in_flight_miss_into_a_failure():
    result = _validate("--strict")
    assert result.exit_code == 1
    assert "4 checks under trtllm-v2-release: 3 passed, 1 failed" in result.stderr
