"""A check that fails under one runtime and passes under another, said as the difference it met.

A connector written against one runtime's behaviour (pages of the whole prompt at the first chunk,
no second ask after a replay, a reservation never released) passes there and fails elsewhere; its
failing rows then name the runtime where the same check passed and the rows of the behaviour table
(`runtimes.behaviours`) in which the two differ, for the behaviours the scenario exercises.
"""

from __future__ import annotations

from kvtool.engine.runtimes import RuntimeName
from kvtool.engine.runtimes.behaviours import differences
from kvtool.validate.results import CheckResult, Verdict
from kvtool.validate.scenarios import SCENARIOS


def note_runtime_differences(results: list[CheckResult]) -> list[CheckResult]:
    """`results`, each failed check that passed under another runtime given that evidence last (in place)."""
    passed: dict[tuple[str, str, str], list[str]] = {}
    for r in results:
        if r.verdict is Verdict.PASS and r.runtime:
            passed.setdefault((r.scenario, r.model, r.check), []).append(r.runtime)
    for r in results:
        elsewhere = passed.get((r.scenario, r.model, r.check), [])
        if r.failed and r.runtime and elsewhere:
            r.evidence.append(difference_note(r.scenario, RuntimeName(r.runtime), RuntimeName(elsewhere[0])))
    return results


def difference_note(scenario: str, failing: RuntimeName, passing: RuntimeName) -> str:
    """`passes under X`, and how `failing` differs from it in what `scenario` exercises."""
    exercised = SCENARIOS[scenario].exercises if scenario in SCENARIOS else ()
    rows = differences(exercised, failing, passing)
    if not rows:
        return f"the same check passes under {passing}"
    return (f"the same check passes under {passing}, which differs from {failing} in what this scenario "
            f"exercises: " + " | ".join(rows))
