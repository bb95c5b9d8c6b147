"""`kvtool validate --explore N`: every scenario under N seeds (each a schedule: `schedule`),
stopped at its first failure, which is reported with the seed, the smallest case that still fails
(`shrink`) and the commands that reproduce both."""

from __future__ import annotations

import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from kvtool.validate.harness import Context
from kvtool.validate.results import CheckResult
from kvtool.validate.runner import SETUP
from kvtool.validate.schedule import schedule_for
from kvtool.validate.shrink import Cut, shrink


@dataclass(frozen=True)
class Finding:
    """A scenario and model that failed first at `seed` (under `runtime`)."""

    scenario: str
    model: str
    seed: int
    checks: tuple[str, ...]
    runtime: str = ""
    smallest: Cut = Cut()
    """The smallest cut of the scenario that still failed all of `checks` at `seed` (Cut(): none smaller)."""
    alone: bool = True
    """It failed again when run alone at `seed`, in a fresh process. False: it passed there, so it
    failed only after the earlier seeds' runs in the same process (state the connector keeps
    across engines), or it depends on timing."""
    first_seed: int | None = None
    """The explored seeds' first: where a run that reproduces a finding not `alone` starts."""

    @property
    def where(self) -> str:
        """`scenario[model]`, or `scenario[model, runtime]` where a runtime is named."""
        return f"{self.scenario}[{self.model}{', ' + self.runtime if self.runtime else ''}]"

    def line(self, reproduce: str) -> str:
        after = "" if self.alone else (
            " only after the earlier seeds ran in the same process: alone, in a fresh process, it passed. "
            "Likely state the connector keeps from one engine to the next, or a failure that depends on timing")
        return (f"{self.where} failed {', '.join(self.checks)} at seed {self.seed}{after} "
                f"({schedule_for(self.seed).describe()}); reproduce: {reproduce}")

    def smallest_line(self, reproduce: str) -> str:
        """The shrink step's outcome, with `reproduce` (the command with `smallest.options()`)."""
        if not self.alone:
            return f"{self.where}: not shrunk (it does not fail alone at its seed)"
        if self.smallest == Cut():
            return f"{self.where}: no smaller case fails (fewer requests or shorter outputs pass)"
        return f"{self.where} smallest failing case: {self.smallest.describe()}; reproduce: {reproduce}"


@dataclass(frozen=True)
class SeedsRun:
    """The seeds a run used, as the summary, JSON and JUnit say them."""

    seed: int
    num_explored: int = 0
    findings: list[Finding] = field(default_factory=list)

    def words(self) -> str:
        if not self.num_explored:
            return f"seed {self.seed}"
        return (f"seeds {self.seed}..{self.seed + self.num_explored - 1} explored, "
                f"{len(self.findings)} scenario{'s' * (len(self.findings) != 1)} failed")

    def as_dict(self) -> dict:
        return {"seed": self.seed, "schedule": schedule_for(self.seed).describe(), "explore": self.num_explored,
                "findings": [{"scenario": f.scenario, "model": f.model, "runtime": f.runtime, "seed": f.seed,
                              "checks": list(f.checks),
                              "max_requests": f.smallest.max_requests, "max_new_tokens": f.smallest.max_new_tokens,
                              "alone": f.alone}
                             for f in self.findings]}

    def properties(self) -> dict[str, str]:
        return {"seed": str(self.seed), "explore": str(self.num_explored)}


RunAll = Callable[[list[Context], list[str], Sequence[int]], list[CheckResult]]
"""`runner.run_all` of these contexts and scenario names, at these seeds (none: each context's own)."""


def explore(contexts: list[Context], names: list[str], num_seeds: int,
            run_all: RunAll) -> tuple[list[CheckResult], list[Finding]]:
    """Every scenario of every context at seeds `ctx.seed`, `ctx.seed + 1`, ... (num_seeds of them;
    the contexts share one seed): a (scenario, model)'s seeds run one after another in one process
    and stop at its first failure (`runner.run_seeds`). A failure is run again alone at its seed,
    in a fresh process: where it fails there too, that run's results stand and it is shrunk at
    that seed (`shrink`); where it passes, the finding says it failed only after the earlier seeds'
    runs (`Finding.alone`). The results: each (scenario, model)'s run at its failing seed, else at
    the first seed, in the serial order."""
    first = contexts[0].seed
    seeds = range(first, first + num_seeds)
    results = run_all(contexts, [n for n in names if n != SETUP], seeds)
    by_model = {(ctx.model, str(ctx.runtime)): ctx for ctx in contexts}
    chosen: list[CheckResult] = []
    findings: list[Finding] = []
    for (scenario, model, runtime), group in _by_scenario(results).items():
        failed = [r.check for r in group if r.failed]
        if scenario == SETUP or not failed:
            chosen += group
            continue
        seed = group[0].seed if group[0].seed is not None else first
        at_seed = replace(by_model[(model, runtime)], seed=seed)
        again = [r for r in run_all([at_seed], [scenario], ()) if r.scenario == scenario]
        failed_again = [r.check for r in again if r.failed]
        if failed_again:   # what the fresh process found stands: its results, its failed checks
            for r in again:
                r.seed = seed
            chosen += again

            def run_one(c: Context, name: str = scenario) -> list[CheckResult]:
                return run_all([c], [name], ())
            smallest = shrink(at_seed, scenario, failed_again, run_one)
            findings.append(Finding(scenario, model, seed, tuple(failed_again), runtime, smallest, first_seed=first))
        else:
            chosen += group
            findings.append(Finding(scenario, model, seed, tuple(failed), runtime, alone=False, first_seed=first))
    return chosen, findings


def _by_scenario(results: list[CheckResult]) -> dict[tuple[str, str, str], list[CheckResult]]:
    groups: dict[tuple[str, str, str], list[CheckResult]] = {}
    for r in results:
        groups.setdefault((r.scenario, r.model, r.runtime), []).append(r)
    return groups


def reproduce_command(target: str, finding: Finding, options: list[str], cut: Cut = Cut()) -> str:
    """`kvtool validate TARGET --scenario S --model M --seed K OPTIONS... CUT`, quoted for a shell;
    for a finding not `alone`, `--seed FIRST --explore K-FIRST+1`: the seeds that led to it."""
    seeds = ["--seed", str(finding.seed)]
    if not finding.alone and finding.first_seed is not None:   # the seeds before it, in one process
        seeds = ["--seed", str(finding.first_seed), "--explore", str(finding.seed - finding.first_seed + 1)]
    runtime = ["--runtime", finding.runtime] if finding.runtime else []
    words = ["kvtool", "validate", target, "--scenario", finding.scenario, "--model", finding.model, *runtime,
             *seeds, *options, *cut.options()]
    return shlex.join(words)
