"""Every case a hook's arguments can take in a real runtime (tests/helpers/hook_cases.py) is
produced by some scenario of `kvtool validate`, so a defect that shows only in that case can be
caught. A scenario change that stops producing a case turns this red."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtool.connectors.registry import load_connector
from kvtool.validate.harness import Context
from kvtool.validate.runner import run_all
from kvtool.validate.scenarios import SCENARIOS
from tests.helpers import hook_cases
from tests.test_validate import SMALL_STORE  # a host store of 8 MiB: nothing evicted, the same hooks called


@pytest.fixture(scope="module")
def cases_by_scenario() -> dict[str, set[str]]:
    spec = load_connector("tests.helpers.hook_cases:RecordingScheduler:RecordingWorker")
    produced = {}
    for name in SCENARIOS:
        hook_cases.RECORDED.clear()
        results = run_all([Context(spec, m, options=SMALL_STORE) for m in ("tiny", "tiny-vswa")],
                          [name], 60, isolated=False)
        assert not [r for r in results if r.failed], [(r.check, r.evidence) for r in results if r.failed]
        produced[name] = set(hook_cases.RECORDED)
    return produced


def test_every_hook_case_is_produced_by_some_scenario(cases_by_scenario):
    produced = set().union(*cases_by_scenario.values())
    assert [c for c in hook_cases.ALL_CASES if c not in produced] == []


def test_the_known_gaps_are_still_gaps(cases_by_scenario):
    produced = set().union(*cases_by_scenario.values())
    assert [c for c in hook_cases.NOT_PRODUCED if c in produced] == [], "a gap closed: move it to ALL_CASES"


@pytest.mark.parametrize(("case", "scenario"), [
    ("ask: local match mid-block, more offered", "local-prefix"),
    ("ask: local match on a block boundary, more offered", "local-prefix"),
    ("alloc: a load follows pages shared with another live request", "local-prefix"),
    ("prompts: a block of the new one is a block of the earlier one at another position", "moved-blocks"),
    ("prompts: the new one extends an earlier prompt and its output", "multi-turn"),
    ("prompts: the new one extends one that ended mid-block", "multi-turn"),
])
def test_the_scenarios_written_for_a_case_produce_it(cases_by_scenario, case, scenario):
    assert case in cases_by_scenario[scenario]


def test_sharing_cases_are_named_by_the_first_difference():
    T = 4
    a = list(range(1, 13))
    assert hook_cases.sharing_case(a[:8], a, T) == "prompts: the new one is a prefix ending on a block boundary"
    assert hook_cases.sharing_case(a[:6], a, T) == "prompts: the new one is a prefix ending mid-block"
    assert hook_cases.sharing_case(a + [99], a, T) == "prompts: the new one extends one that ended on a block boundary"
    assert hook_cases.sharing_case(a[:6] + [99], a, T) == "prompts: diverge mid-block"
    assert hook_cases.sharing_case(a[:4] + [99], a, T) == "prompts: diverge on a block boundary"
    assert hook_cases.sharing_case([99] + a, a, T) == "prompts: share no first block"
    assert hook_cases.moved_block(a[4:8] + a[:4], a, T) and not hook_cases.moved_block(a[:4] + [99] * 4, a, T)


def test_a_real_models_sliding_window_is_reached():
    """A gemma-3-1b-like layout (a 512-token window, hundreds of 4-token blocks): `vswa-live-pages`
    runs at a block size where its prompts pass the window, so page lists hold BAD_PAGE_INDEX there
    as they do on tiny-vswa."""
    config = Path(__file__).resolve().parent / "data" / "hf_configs" / "gemma3-1b-like-6-layers" / "config.json"
    spec = load_connector("tests.helpers.hook_cases:RecordingScheduler:RecordingWorker")
    hook_cases.RECORDED.clear()
    results = run_all([Context(spec, str(config))], ["vswa-live-pages"], 60, isolated=False)
    assert [(r.check, r.verdict.value) for r in results] == [("registration", "pass"), ("integrity", "pass")]
    assert "alloc: a page list holds BAD_PAGE_INDEX" in hook_cases.RECORDED
