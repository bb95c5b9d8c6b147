"""The shrink step of `kvtool validate --explore`: a scenario that failed at a seed is run again at
that seed with fewer requests and shorter outputs, and the smallest case that still fails the same
checks is reported (with `--max-requests K --max-new-tokens M`, which reproduce it).

A cut (`Cut`) keeps the first K requests of every engine run of the scenario (its requests are
listed in arrival order) and caps every request's output at M tokens (fewer decode iterations);
the reference runs the judges compare against see the same cut. A smaller case counts only when
every check that failed at full size fails again: a probe whose scenario stops on an error (a
judge naming a request the cut removed) does not count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeAlias

# harness imports this module (so no import back, not even for the type checker: the architecture
# test counts it as a loop): its Context and Req, and results' CheckResult, are named in words.
Context: TypeAlias = Any
Req: TypeAlias = Any
CheckResult: TypeAlias = Any

MAX_PROBED_REQUESTS = 64
"""The request counts tried go 1, 2, 4, ... up to this (no scenario lists more)."""
MAX_PROBED_TOKENS = 8
"""Output caps tried: 1, 2, 4, 8 (the scenarios generate a few tokens a request)."""
MAX_ROUNDS = 3


@dataclass(frozen=True)
class Cut:
    """At most `max_requests` requests per engine run (None: all), each generating at most
    `max_new_tokens` (None: as the scenario asked)."""

    max_requests: int | None = None
    max_new_tokens: int | None = None

    def apply(self, requests: Sequence[Req]) -> list[Req]:
        kept = list(requests[:self.max_requests] if self.max_requests is not None else requests)
        if self.max_new_tokens is None:
            return kept
        return [replace(q, max_new_tokens=min(q.max_new_tokens, self.max_new_tokens)) for q in kept]

    def options(self) -> list[str]:
        """The command-line options that make this cut."""
        words = ["--max-requests", str(self.max_requests)] if self.max_requests is not None else []
        return words + (["--max-new-tokens", str(self.max_new_tokens)] if self.max_new_tokens is not None else [])

    def short(self) -> str:
        """`K requests, M tokens` ('all' where not cut): for progress lines."""
        return f"{self.max_requests or 'all'} requests, {self.max_new_tokens or 'all'} tokens"

    def describe(self) -> str:
        requests = f"first {self.max_requests} requests" if self.max_requests is not None else "all requests"
        outputs = (f"at most {self.max_new_tokens} new token{'s' * (self.max_new_tokens != 1)}"
                   if self.max_new_tokens is not None else "full outputs")
        return f"{requests} of each run, {outputs}"


RunOne: TypeAlias = Callable[[Context], list[CheckResult]]


def reproduces(results: Iterable[CheckResult], scenario: str, checks: Sequence[str]) -> bool:
    """Every one of `checks` failed again in `scenario`'s results."""
    failed = {r.check for r in results if r.scenario == scenario and r.failed}
    return set(checks) <= failed


def shrink(ctx: Context, scenario: str, checks: Sequence[str], run_one: RunOne) -> Cut:
    """The smallest cut of `scenario` at `ctx` (the failing seed's context) that fails all of
    `checks` again: the fewest requests first (1, 2, 4, ... then halving between the last that
    passed and the first that failed), then, with that many, the shortest outputs (1, 2, 4, ...),
    and again while a round finds a smaller case (shorter outputs can make fewer requests fail).
    Cut() when nothing smaller fails."""
    tried: dict[Cut, bool] = {}

    def fails(cut: Cut) -> bool:
        if cut not in tried:
            tried[cut] = reproduces(run_one(replace(ctx, cut=cut)), scenario, checks)
        return tried[cut]

    cut = Cut()
    for _ in range(MAX_ROUNDS):
        # _smallest calls them before the loop goes on: each closure reads this round's cut and requests
        requests = _smallest(lambda k: fails(Cut(k, cut.max_new_tokens)))  # noqa: B023
        tokens = _smallest(lambda m: fails(Cut(requests, m)), limit=MAX_PROBED_TOKENS)  # noqa: B023
        if Cut(requests, tokens) == cut:
            break
        cut = Cut(requests, tokens)
    return cut


def _smallest(fails: Callable[[int], bool], limit: int = MAX_PROBED_REQUESTS) -> int | None:
    """The smallest n in 1..limit found failing by doubling then bisecting (None: none did)."""
    passed, n = 0, 1
    while n <= limit and not fails(n):
        passed, n = n, n * 2
    if n > limit:
        return None
    while n - passed > 1:
        middle = (passed + n) // 2
        passed, n = (passed, middle) if fails(middle) else (middle, n)
    return n
