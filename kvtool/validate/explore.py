"""`kvtool validate --explore N`: every scenario under N seeds (each a schedule: `schedule`),
stopped at its first failure, which is reported with the seed and a command that reproduces it."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field, replace
from typing import Callable

from kvtool.validate.harness import Context
from kvtool.validate.results import CheckResult
from kvtool.validate.runner import SETUP
from kvtool.validate.schedule import schedule_for


@dataclass(frozen=True)
class Finding:
    """A scenario and model that failed first at `seed`."""

    scenario: str
    model: str
    seed: int
    checks: tuple[str, ...]

    def line(self, reproduce: str) -> str:
        return (f"{self.scenario}[{self.model}] failed {', '.join(self.checks)} at seed {self.seed} "
                f"({schedule_for(self.seed).describe()}); reproduce: {reproduce}")


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
                "findings": [{"scenario": f.scenario, "model": f.model, "seed": f.seed, "checks": list(f.checks)}
                             for f in self.findings]}

    def properties(self) -> dict[str, str]:
        return {"seed": str(self.seed), "explore": str(self.num_explored)}


RunAll = Callable[[list[Context], list[str]], list[CheckResult]]


def explore(contexts: list[Context], names: list[str], num_seeds: int,
            run_all: RunAll) -> tuple[list[CheckResult], list[Finding]]:
    """Seeds `ctx.seed`, `ctx.seed + 1`, ... (num_seeds of them) for every scenario of every
    context; a (scenario, model) that fails is not run again. The results: each (scenario,
    model)'s run at its failing seed, else at the first seed, in the first seed's order."""
    remaining = {ctx.model: [n for n in names if n != SETUP] for ctx in contexts}
    chosen: dict[tuple[str, str], list[CheckResult]] = {}
    findings: list[Finding] = []
    for k in range(num_seeds):
        for ctx in contexts:
            todo = remaining[ctx.model]
            if not todo:
                continue
            seed = ctx.seed + k
            for key, group in _by_scenario(run_all([replace(ctx, seed=seed)], todo)).items():
                failed = [r.check for r in group if r.failed]
                if failed or key not in chosen:
                    chosen[key] = group
                if failed and key[0] in todo:
                    todo.remove(key[0])
                    findings.append(Finding(key[0], key[1], seed, tuple(failed)))
    return [r for group in chosen.values() for r in group], findings


def _by_scenario(results: list[CheckResult]) -> dict[tuple[str, str], list[CheckResult]]:
    groups: dict[tuple[str, str], list[CheckResult]] = {}
    for r in results:
        groups.setdefault((r.scenario, r.model), []).append(r)
    return groups


def reproduce_command(target: str, finding: Finding, options: list[str]) -> str:
    """`kvtool validate TARGET --scenario S --model M --seed K OPTIONS...`, quoted for a shell."""
    words = ["kvtool", "validate", target, "--scenario", finding.scenario, "--model", finding.model,
             "--seed", str(finding.seed), *options]
    return shlex.join(words)
