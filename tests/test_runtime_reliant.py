"""A connector that relies on one runtime's behaviour passes there and fails under another, with
evidence naming the difference (the rows of the runtimes' behaviour table the scenario exercises)."""

from __future__ import annotations

from kvtool.connectors.registry import load_connector
from kvtool.engine.runtimes import RUNTIMES
from kvtool.validate.harness import Context
from kvtool.validate.results import Verdict
from kvtool.validate.runner import run_all
from kvtool.validate.runtime_differences import note_runtime_differences

HELPERS = "tests.helpers.runtime_reliant"


def _validate(target: str, scenarios: list[str]):
    spec = load_connector(f"{HELPERS}:{target}")
    contexts = [Context(spec, "tiny", runtime=name) for name in RUNTIMES]
    return note_runtime_differences(run_all(contexts, scenarios, 60, isolated=False))


def _failed(results) -> dict[str, set[tuple[str, str]]]:
    out: dict[str, set[tuple[str, str]]] = {}
    for r in results:
        if r.failed:
            out.setdefault(r.runtime, set()).add((r.scenario, r.check))
    return out


def test_pages_of_the_whole_prompt_at_the_first_chunk_fail_under_v2_naming_the_difference():
    results = _validate("FirstChunkPagesOnly:Worker", ["chunked-prefill"])
    assert _failed(results) == {"trtllm-v2": {("chunked-prefill", "integrity")},
                                "trtllm-v2-release": {("chunked-prefill", "integrity")}}
    failing = next(r for r in results if r.failed and r.runtime == "trtllm-v2")
    assert "the same check passes under trtllm-v1" in failing.evidence[-1]
    assert "pages at the first chunk: trtllm-v2: the chunk's" in failing.evidence[-1]
    assert "trtllm-v1: the whole prompt's" in failing.evidence[-1]


def test_no_second_ask_fails_a_replay_under_v2_saying_v1_never_replays():
    results = _validate("AskedOnce:Worker", ["pause-replay"])
    assert _failed(results) == {"trtllm-v2": {("pause-replay", "integrity")},
                                "trtllm-v2-release": {("pause-replay", "integrity")}}
    assert [r.verdict for r in results if r.runtime == "trtllm-v1" and r.scenario == "pause-replay"] == [Verdict.SKIP]
    failing = next(r for r in results if r.failed and r.runtime == "trtllm-v2")
    assert any("asked twice about request" in e for e in failing.evidence)
    assert "under trtllm-v1 this case cannot happen (V1 runs a connector only under GUARANTEED_NO_EVICT" \
        in failing.evidence[-1]
    assert "asked again: trtllm-v2: once per allocation" in failing.evidence[-1]


def test_a_reservation_never_released_fails_under_main_v2_only():
    results = _validate("NeverReleases:ReservingWorker", ["clamp"])
    assert _failed(results) == {"trtllm-v2": {("clamp", "holds-nothing")}}
    failing = next(r for r in results if r.failed)
    assert "store entries still pinned after every request finished" in failing.evidence[0]
    assert "the same check passes under trtllm-v1" in failing.evidence[-1]
    assert "prefix reservations: trtllm-v2: for a connector implementing" in failing.evidence[-1]
