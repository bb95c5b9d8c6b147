"""`--explore`'s shrink step reports the smallest case that still fails, exactly, and the command
that reproduces it does fail."""

from __future__ import annotations

import shlex

from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.connector.loader import ConnectorSpec
from kvtool.validate.harness import Context
from kvtool.validate.runner import run_scenario
from kvtool.validate.shrink import Cut, _smallest, shrink
from tests.helpers.early_report_connectors import ClaimsOneBlockMore, EarlyReport, EarlyReportWorker, Worker

MODULE = "tests.helpers.early_report_connectors"
CLAIMS = ConnectorSpec("claims", ClaimsOneBlockMore, Worker, MODULE)
cli = CliRunner()


def _integrity(spec: ConnectorSpec, scenario: str, cut: Cut) -> str:
    (check,) = [r for r in run_scenario(scenario, Context(spec, "tiny", cut=cut)) if r.check == "integrity"]
    return check.verdict.value


def _shrunk(spec: ConnectorSpec, scenario: str) -> tuple[Cut, list[Cut]]:
    probes = []

    def run_one(ctx):
        probes.append(ctx.cut)
        return run_scenario(scenario, ctx)

    return shrink(Context(spec, "tiny"), scenario, ["integrity"], run_one), probes


def test_an_offer_one_block_past_the_index_shrinks_to_its_two_requests_and_one_token():
    # cold-warm: request 0 stores the prompt, request 1 repeats it and is offered one block more
    # than was stored; request 2 is not needed, nor a second generated token.
    smallest, probes = _shrunk(CLAIMS, "cold-warm")
    assert smallest == Cut(max_requests=2, max_new_tokens=1)
    assert probes == [Cut(1), Cut(2), Cut(2, 1), Cut(1, 1)]
    assert _integrity(CLAIMS, "cold-warm", Cut(1, 1)) == "pass"      # one fewer request: nothing to offer
    assert _integrity(CLAIMS, "cold-warm", Cut()) == "fail"


def test_an_early_report_shrinks_to_two_requests_and_one_token():
    # async-save: every save of request 0 is held to the gate (its pass's saves start once the gate
    # shut), so at the early report none has landed and request 1, which repeats the prompt,
    # loads poison whatever the outputs' length; request 2 is not needed, nor a second token.
    early = ConnectorSpec("early-report", EarlyReport, EarlyReportWorker, MODULE)
    smallest, probes = _shrunk(early, "async-save")
    assert smallest == Cut(max_requests=2, max_new_tokens=1)
    assert probes == [Cut(1), Cut(2), Cut(2, 1), Cut(1, 1)]
    assert _integrity(early, "async-save", Cut(2)) == "fail"
    assert _integrity(early, "async-save", Cut(1)) == "pass"


@given(st.integers(1, 80))
def test_the_search_finds_the_smallest_failing_size_of_a_monotone_failure(threshold):
    tried = []

    def fails(n):
        tried.append(n)
        return n >= threshold

    assert _smallest(fails) == (threshold if threshold <= 64 else None)
    assert len(tried) <= 2 * 7


def test_explore_prints_the_smallest_case_and_its_command_reproduces_it():
    target = "tests/helpers/early_report_connectors.py:ClaimsOneBlockMore:Worker"
    result = cli.invoke(app, ["validate", target, "--scenario", "cold-warm", "--model", "tiny", "--explore", "1",
                              "--runtime", "trtllm-v2-release", "--device", "cpu"])
    assert result.exit_code == 1
    command = (f"kvtool validate {target} --scenario cold-warm --model tiny --runtime trtllm-v2-release --seed 0 "
               "--device cpu --max-requests 2 --max-new-tokens 1")
    assert ("cold-warm[tiny, trtllm-v2-release] smallest failing case: first 2 requests of each run, at most 1 new "
            f"token; reproduce: {command}") in result.stderr
    again = cli.invoke(app, [*shlex.split(command)[1:], "--format", "json"])
    assert again.exit_code == 1
    assert '"check": "integrity",\n      "verdict": "fail"' in again.stdout


def test_a_cut_of_no_requests_is_a_usage_error():
    result = cli.invoke(app, ["validate", "host", "--scenario", "clamp", "--max-requests", "0"])
    assert result.exit_code == 2
    assert "--max-requests must be a positive integer, got 0" in result.stderr
