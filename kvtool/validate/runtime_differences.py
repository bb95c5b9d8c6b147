"""A check that fails under one runtime and passes under another, said as the difference it met.

A connector written against one runtime's behaviour (pages of the whole prompt at the first chunk,
no second ask after a replay, a reservation never released) passes there and fails elsewhere; its
failing rows then name the runtime where the same check passed and the rows of the behaviour table
(`runtimes.behaviours`) in which the two differ, for the behaviours the scenario exercises.
"""

from __future__ import annotations

from kvtool.engine.runtimes.behaviours import differences
from kvtool.engine.runtimes.names import RuntimeName
from kvtool.validate.results import CheckResult, Verdict
from kvtool.validate.scenarios import SCENARIOS


def note_runtime_differences(results: list[CheckResult]) -> list[CheckResult]:
    """`results`, each failed check given one line of evidence more (in place) where another
    runtime passed the same check, or could not run the scenario at all (its case cannot happen there)."""
    passed: dict[tuple[str, str, str], list[str]] = {}
    not_run: dict[tuple[str, str], list[str]] = {}
    for r in results:
        if r.verdict is Verdict.PASS and r.runtime:
            passed.setdefault((r.scenario, r.model, r.check), []).append(r.runtime)
        elif r.verdict is Verdict.SKIP and r.check == "scenario" and r.runtime:
            not_run.setdefault((r.scenario, r.model), []).append(r.runtime)
    for r in results:
        if not (r.failed and r.runtime):
            continue
        elsewhere = passed.get((r.scenario, r.model, r.check), [])
        if elsewhere:
            r.evidence.append(difference_note(r.scenario, RuntimeName(r.runtime), RuntimeName(elsewhere[0])))
        elif not_run.get((r.scenario, r.model)):
            r.evidence.append(not_run_note(r.scenario, RuntimeName(r.runtime),
                                           RuntimeName(not_run[(r.scenario, r.model)][0])))
    return results


def difference_note(scenario: str, failing: RuntimeName, passing: RuntimeName) -> str:
    """`passes under X`, and how `failing` differs from it in what `scenario` exercises."""
    rows = differences(_exercised(scenario), failing, passing)
    if not rows:
        return f"the same check passes under {passing}"
    return (f"the same check passes under {passing}, which differs from {failing} in what this scenario "
            f"exercises: " + " | ".join(rows))


def not_run_note(scenario: str, failing: RuntimeName, other: RuntimeName) -> str:
    """The scenario cannot run under `other` (its case does not happen there), and how the two differ."""
    rows = differences(_exercised(scenario), failing, other)
    reason = SCENARIOS[scenario].not_here if scenario in SCENARIOS else ""
    return (f"under {other} this case cannot happen ({reason})" if reason
            else f"under {other} this scenario does not run") \
        + (f"; {failing} differs from it in: " + " | ".join(rows) if rows else "")


def _exercised(scenario: str) -> tuple:
    return SCENARIOS[scenario].exercises if scenario in SCENARIOS else ()
