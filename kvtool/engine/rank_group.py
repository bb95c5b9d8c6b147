"""The ranks of a run as rank 0's engine sees them: one seam, `RankGroup`, whatever process each
rank lives in.

Every rank, rank 0 included, runs the same `RankPass` on each order. `LocalRankGroup`: one
process, rank 0's `RankPass` drives every rank's worker on rank 0's pages. `ProcessRankGroup`:
rank 0 runs its `RankPass` in this process while ranks 1..N-1 run theirs as follower processes
(`ranks.Followers`): each order is broadcast with the page operations rank 0's manager did since
the last one, and the followers' reports are folded in (hook failures, integrity issues, and with
tensor parallelism the checksums of their shards).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

from kvtool.connector.loader import ConnectorSpec
from kvtool.connector.runtime import HookFailure, HookResult
from kvtool.engine.engine_config import EngineConfig
from kvtool.engine.integrity import CHECKSUM_MASK
from kvtool.engine.pass_types import PassItem
from kvtool.engine.rank_orders import FinishedOrder, PassOrder, RankReport, RankSetup
from kvtool.engine.rank_pass import RankPass
from kvtool.engine.ranks import Followers
from kvtool.engine.runtimes import profile_of
from kvtool.manager.manager import KvCacheManager


@dataclass
class PassOutcome:
    ok: bool
    """No hook raised on any rank."""
    failures: list[HookFailure] = field(default_factory=list)
    """The hooks that raised on other ranks, for the runtime's record (rank 0's own hooks are
    recorded by its guard as they raise)."""


@dataclass
class FinishedOutcome:
    answers: dict[int, HookResult]
    """Rank -> (its get_finished ran without raising, what it returned)."""
    prefix_loads: dict[int, HookResult] = field(default_factory=dict)
    """Rank -> (its get_finished_prefix_loads ran without raising, what it returned): asked only
    with `FinishedOrder.prefix_loads`."""
    failures: list[HookFailure] = field(default_factory=list)
    """The hooks that raised on other ranks (rank 0's are recorded by its guard as they raise)."""


class RankGroup(Protocol):
    """Contract: `run_pass` and `finish` run the order on every rank and return once every rank
    has; a rank that dies or hangs raises `ranks.RankGroupError` naming it."""

    num_local_ranks: int
    """How many ranks' workers live in this process (rank 0's `RankPass` drives them all)."""
    needs_idle_pages: bool
    """Whether a `PassOrder` should carry the idle requests' pages to verify (the followers',
    which keep no request state to find them; rank 0 checks every live page itself)."""

    def run_pass(self, order: PassOrder) -> PassOutcome: ...

    def finish(self, order: FinishedOrder) -> FinishedOutcome: ...

    def close(self) -> None: ...


class LocalRankGroup:
    """Every rank in this process, on rank 0's pages."""

    needs_idle_pages = False

    def __init__(self, rank0: RankPass, num_ranks: int) -> None:
        self.rank0 = rank0
        self.num_local_ranks = num_ranks

    def run_pass(self, order: PassOrder) -> PassOutcome:
        return PassOutcome(self.rank0.run_pass(order, RankReport(0)))

    def finish(self, order: FinishedOrder) -> FinishedOutcome:
        return FinishedOutcome(self.rank0.finish(order), self.rank0.prefix_answers)

    def close(self) -> None:
        """Nothing to stop."""


class ProcessRankGroup:
    """Rank 0 here, ranks 1..N-1 as follower processes with shards of their own."""

    num_local_ranks = 1

    def __init__(self, rank0: RankPass, followers: Followers, manager: KvCacheManager, tp_size: int,
                 verify_idle_pages: bool) -> None:
        self.rank0 = rank0
        self.followers = followers
        self.needs_idle_pages = verify_idle_pages
        self._manager = manager
        self._tp_size = tp_size

    def run_pass(self, order: PassOrder) -> PassOutcome:
        order.page_ops = self._take_page_log()
        self.followers.broadcast(order)
        # Rank 0 checks every live page itself at the end of the iteration (`Engine.verify_all`).
        ok = self.rank0.run_pass(replace(order, verify=[]), RankReport(0))
        outcome = self._merged(self.followers.gather(), order.items)
        outcome.ok = outcome.ok and ok
        return outcome

    def finish(self, order: FinishedOrder) -> FinishedOutcome:
        order.page_ops = self._take_page_log()
        self.followers.broadcast(order)
        outcome = FinishedOutcome(self.rank0.finish(order), dict(self.rank0.prefix_answers))
        for report in self.followers.gather():
            outcome.answers[report.rank] = report.finished
            if order.prefix_loads:
                outcome.prefix_loads[report.rank] = report.prefix_loads
            outcome.failures += [HookFailure(hook, None, error, text)
                                 for (hook, error), text in zip(report.failures, report.tracebacks, strict=True)]
        return outcome

    def close(self) -> None:
        self.followers.close()

    def _take_page_log(self) -> list[tuple]:
        """The byte operations rank 0's manager did on pages since the last order (poison,
        copy-on-write), for the followers to replay on their shards."""
        log, self._manager.page_log = self._manager.page_log, []
        assert log is not None   # rank 0's manager logs page operations while it has followers
        return log

    def _merged(self, reports: list[RankReport], items: list[PassItem]) -> PassOutcome:
        """The followers' pass reports folded in: their integrity issues into rank 0's fake engine,
        (tensor parallel) their checksums into the pass items; not ok when a hook raised."""
        outcome = PassOutcome(True)
        by_id = {item.request_id: item for item in items}
        for report in reports:
            for (hook, error), text in zip(report.failures, report.tracebacks, strict=True):
                outcome.failures.append(HookFailure(hook, None, error, text))
                outcome.ok = False
            self.rank0.fake.merge(report.issues, report.errors_by_request, report.rank)
            if self._tp_size > 1:
                for request_id, checksum in report.checksums.items():
                    by_id[request_id].checksum = (by_id[request_id].checksum + checksum) & CHECKSUM_MASK
        return outcome


def start_followers(config: EngineConfig, manager: KvCacheManager, spec: ConnectorSpec | None,
                    options: dict[str, str]) -> Followers | None:
    """The follower processes `config` asks for (None: every rank lives in this process). Rank 0's
    manager logs its byte operations on pages from now on, for them to replay."""
    if not config.ranks_as_processes or (config.num_ranks == 1 and not config.process_group_of_one):
        return None
    manager.page_log = []
    profile = profile_of(config.runtime)
    return Followers(RankSetup(config.manager, tuple(manager.num_slots), config.tp_size, config.num_ranks,
                               config.seed, spec, tuple(options.items()), 0, config.rank_timeout_s,
                               manager.device.type, profile.registration, profile.use_kv_cache_manager_v2))


def rank_group(rank0: RankPass, followers: Followers | None, config: EngineConfig,
               manager: KvCacheManager) -> RankGroup:
    """The group around rank 0's `RankPass`: local, or with `followers` (`start_followers`)."""
    if followers is None:
        return LocalRankGroup(rank0, config.num_ranks)
    return ProcessRankGroup(rank0, followers, manager, config.tp_size, config.verify_all_after_iteration)
