"""The checks of a vLLM scenario, each reading a finished `VllmRun`'s records (its outcomes, step
records, integrity findings and vLLM's block pool), never driving it."""

from __future__ import annotations

from kvtool.validate.results import CheckResult, Verdict
from kvtool.vllm_compat.driver import VllmRun


def integrity(scenario: str, model: str, run: VllmRun) -> CheckResult:
    """Every position attention read, and every running request's positions after every step,
    held exactly the fingerprints a full recompute writes."""
    found = run.integrity
    discarded = (f" ({found.num_discarded} wrong reads of steps vLLM threw away after a load failure)"
                 if found.num_discarded else "")
    if not found.num_wrong:
        return CheckResult(scenario, model, "integrity", Verdict.PASS, evidence=["every byte read matched" + discarded])
    return CheckResult(scenario, model, "integrity", Verdict.FAIL,
                       evidence=[f"{found.num_wrong} token-layer reads differ from a full recompute"]
                       + [issue.describe() for issue in found.issues[:5]])


def warm_hit(scenario: str, model: str, run: VllmRun, request_id: str, at_least: int = 1) -> CheckResult:
    """`request_id` was scheduled with at least `at_least` tokens computed (a repeat served)."""
    outcome = run.outcomes[request_id]
    computed = outcome.first_computed or 0
    evidence = [f"request {request_id} scheduled with {computed} of {outcome.prompt_len} prompt tokens computed"]
    return CheckResult(scenario, model, "warm-hit", Verdict.PASS if computed >= at_least else Verdict.MISS,
                       evidence=evidence)


def requests_finish(scenario: str, model: str, run: VllmRun, reasons: dict[str, str] | None = None) -> CheckResult:
    """Every request finished, with its expected finish reason (default "length")."""
    reasons = reasons or {}
    wrong = [f"{o.request_id}: {o.finish_reason or 'unfinished'} (expected {reasons.get(o.request_id, 'length')})"
             for o in run.outcomes.values() if o.finish_reason != reasons.get(o.request_id, "length")]
    if wrong:
        return CheckResult(scenario, model, "requests-finish", Verdict.FAIL, evidence=wrong[:5])
    return CheckResult(scenario, model, "requests-finish", Verdict.PASS,
                       evidence=[f"{len(run.outcomes)} requests finished as expected"])


def holds_nothing(scenario: str, model: str, run: VllmRun) -> CheckResult:
    """Once every request finished, vLLM holds no block and no request (a `delay_free` answered True
    was followed by `finished_sending`)."""
    pool = run.scheduler.kv_cache_manager.block_pool
    held = [b.block_id for b in pool.blocks if b.ref_cnt > 0 and not b.is_null]
    left = sorted(run.scheduler.requests)
    if held or left:
        return CheckResult(scenario, model, "holds-nothing", Verdict.FAIL,
                           evidence=[f"after the run vLLM still holds blocks {held[:12]} for requests {left[:6]} "
                                     "(a delayed free never reported in finished_sending?)"])
    return CheckResult(scenario, model, "holds-nothing", Verdict.PASS, evidence=["every block was freed"])


def finished_ids(scenario: str, model: str, run: VllmRun) -> CheckResult:
    """`finished_sending` names only requests the worker was told finished (`finished_req_ids`,
    this step or an earlier one), each once; `finished_recving` each request once."""
    told: set[str] = set()
    sent: set[str] = set()
    received: set[str] = set()
    wrong: list[str] = []
    for step in run.steps:
        told |= step.finished_req_ids
        wrong += [f"step {step.index}: finished_sending {rid} before the worker was told it finished"
                  for rid in sorted(step.finished_sending - told)]
        wrong += [f"step {step.index}: {rid} reported again" for rid in sorted(step.finished_sending & sent)]
        wrong += [f"step {step.index}: finished_recving {rid} again"
                  for rid in sorted(step.finished_recving & received)]
        sent |= step.finished_sending
        received |= step.finished_recving
    if wrong:
        return CheckResult(scenario, model, "finished-ids", Verdict.FAIL, evidence=wrong[:5])
    return CheckResult(scenario, model, "finished-ids", Verdict.PASS,
                       evidence=[f"{len(sent)} sends and {len(received)} loads reported, each once, in time"])


def skipped(scenario: str, model: str, check: str, why: str) -> CheckResult:
    return CheckResult(scenario, model, check, Verdict.SKIP, evidence=[why])


def standard(scenario: str, model: str, run: VllmRun) -> list[CheckResult]:
    """The checks every scenario makes: bytes, requests finished, ids reported, nothing held."""
    return [integrity(scenario, model, run), requests_finish(scenario, model, run),
            finished_ids(scenario, model, run), holds_nothing(scenario, model, run)]
