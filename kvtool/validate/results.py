"""Checks and their verdicts."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field


class Verdict(str, enum.Enum):
    PASS = "pass"
    MISS = "miss"
    """The connector served less than it could (e.g. declined a partial local match): not wrong,
    reported as a finding of its own kind; a failure under `--strict`."""
    FAIL = "fail"
    ERROR = "error"
    SKIP = "skip"


CHECKS: dict[str, str] = {
    "registration": "the worker accepts the KV cache layout (or, for a single-tensor worker, the pool tensor)",
    "integrity": "every byte the connector loaded matches a full recompute, and outputs agree token for token "
                 "with a run without the connector",
    "warm-hit": "a prompt the connector has seen is served by it the next time",
    "holds-nothing": "once its requests finished, were cancelled or freed, the connector holds nothing for them",
    "load-completes": "asynchronous loads are reported within the bound, never left in transmission",
    "finished-ids": "get_finished returns only ids it was given, each once",
    "survives-hook-failure": "after one of its hooks raised, the other requests and later ones are served "
                             "correctly and the failed request's state is dropped",
    "answers-in-contract": "answers are (count >= 0, is_async) pairs, never (0, True), never past the prompt",
    "salt-isolation": "no block is served across different cache salts",
    "reservations": "every prefix reservation (main's V2) ends released, each token exactly once: every confirmed "
                    "load reported by every worker, every unused part handed back",
}


@dataclass
class CheckResult:
    scenario: str
    model: str
    check: str
    verdict: Verdict
    seconds: float = 0.0
    evidence: list[str] = field(default_factory=list)
    tracebacks: list[str] = field(default_factory=list)
    """The whole traceback of each connector hook failure (and stopped run) of the scenario, each
    headed by what failed: on the scenario's first result that did not pass, none when all passed."""
    seed: int | None = None
    """The seed of the run that made this result, where one process ran a scenario at several
    (`--explore`: `runner.run_seeds`); None where the run's seed is the context's."""
    runtime: str = ""
    """The runtime profile the scenario ran under (`--runtime`; the runner stamps it)."""

    @property
    def purpose(self) -> str:
        return CHECKS.get(self.check, "")

    @property
    def failed(self) -> bool:
        return self.verdict in (Verdict.FAIL, Verdict.ERROR)

    def as_dict(self) -> dict:
        data = asdict(self)
        if self.seed is None:
            del data["seed"]
        data["verdict"] = self.verdict.value
        data["purpose"] = self.purpose
        return data


def verdict(ok: bool) -> Verdict:
    return Verdict.PASS if ok else Verdict.FAIL


def summary_line(results: list[CheckResult]) -> str:
    """`72 checks under trtllm-v1: 60 passed, 2 missed, 8 skipped, 2 failed` (kinds with none left
    out, but passed); over several runtimes, the whole count then each runtime's in brackets."""
    runtimes = list(dict.fromkeys(r.runtime for r in results if r.runtime))
    if len(runtimes) == 1:
        return f"{len(results)} checks under {runtimes[0]}: {_counts(results)}"
    line = f"{len(results)} checks: {_counts(results)}"
    if runtimes:
        line += " (" + "; ".join(f"{name}: {_counts([r for r in results if r.runtime == name])}"
                                 for name in runtimes) + ")"
    return line


def _counts(results: list[CheckResult]) -> str:
    counts = {v: sum(r.verdict is v for r in results) for v in Verdict}
    words = [("passed", counts[Verdict.PASS]), ("missed", counts[Verdict.MISS]), ("skipped", counts[Verdict.SKIP]),
             ("failed", counts[Verdict.FAIL]), ("errors", counts[Verdict.ERROR])]
    return ", ".join(f"{n} {word}" for word, n in words if n or word == "passed")
