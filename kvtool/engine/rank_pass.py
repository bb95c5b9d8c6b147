"""One rank's share of an iteration, the same code on every rank (rank 0 included), and the one
factory every rank's connector worker is built by.

A `RankPass` is a rank's fake engine and its `PassDriver`. Given a `PassOrder` it writes the
contexts received from elsewhere, runs the pass (`pass_driver` steps 1-2), verifies the idle pages
it was sent and reports its sampling checksums and integrity issues; given a `FinishedOrder` it runs
`get_finished` (step 4) and then rewinds and forgets what the fake engine keeps for requests.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from kvtool.connector.api import KvCacheConnectorWorker
from kvtool.connector.loader import ConnectorSpec
from kvtool.connector.rank_context import acting_as
from kvtool.connector.runtime import HookResult
from kvtool.engine.pass_driver import PassDriver, RankWorker, ask_end_of_pass
from kvtool.engine.pass_types import KvBytesModel
from kvtool.engine.rank_orders import FinishedOrder, PassOrder, RankReport
from kvtool.engine.runtimes.names import Registration
from kvtool.engine.worker_setup import rank_llm_args, register_worker
from kvtool.manager.manager import KvCacheManager


class WorkerFactory:
    """How a rank's connector worker is built, on rank 0 and on a follower alike: `construct` it
    with its shard's runtime arguments, then `ready` it (the layout registered, its forward-pass
    callable asked). Both raise what the connector raised; the caller says it in its own words.
    `enter` is told each stage before it runs (a follower publishes it, to name a failure)."""

    def __init__(self, spec: ConnectorSpec, options: dict[str, str], manager: KvCacheManager, num_ranks: int,
                 tp_size: int, enter: Callable[[str], None] = lambda stage: None,
                 registration: Registration = Registration.LAYOUT, use_kv_cache_manager_v2: bool = True) -> None:
        self.spec = spec
        self.registration = registration
        self.use_kv_cache_manager_v2 = use_kv_cache_manager_v2
        self.options = options
        self._manager = manager
        self._num_ranks = num_ranks
        self._tp_size = tp_size
        self._enter = enter

    def construct(self, rank: int) -> KvCacheConnectorWorker:
        self._enter("constructing the worker")
        with acting_as(rank):
            return self.spec.worker_class(rank_llm_args(self._manager, self.spec, self.options, rank,
                                                        self._num_ranks, self._tp_size, self.use_kv_cache_manager_v2))

    def ready(self, rank: int, worker: KvCacheConnectorWorker) -> RankWorker:
        """`worker` with the layout registered and its forward-pass callable asked (ConnectorError
        when that answer is not one)."""
        self._enter(self.registration)
        with acting_as(rank):
            register_worker(worker, self._manager, self.registration)
        return RankWorker(rank, worker, ask_end_of_pass(worker, rank))


class RankPass:
    """One rank's fake engine (`fake`: bytes, blocks or tokens) driven by its `PassDriver`.
    `after_forward` runs once the pass's hooks are done (rank 0 closes its async gate there)."""

    def __init__(self, rank: int, fake: KvBytesModel, driver: PassDriver,
                 after_forward: Callable[[], None] = lambda: None) -> None:
        self.rank = rank
        self.fake = fake
        self.driver = driver
        self.prefix_answers: dict[int, HookResult] = {}
        """Rank -> (ok, ids) of the last `finish`'s `get_finished_prefix_loads` calls."""
        self._after_forward = after_forward

    def run_pass(self, order: PassOrder, report: RankReport) -> bool:
        """Run `order` on this rank, filling `report` with its checksums and the integrity issues
        found meanwhile; False when a hook raised (the guard recorded it)."""
        for item in order.received:
            self.fake.write_context(item)
        before = Counter(self.fake.errors_by_request)
        num_issues = len(self.fake.issues)
        ok = self.driver.run_pass(order.plan, order.metadata, order.items)
        self._after_forward()
        for item in order.verify:
            self.fake.verify_cache(item.request_id, item.tokens, item.pages, item.end)
        report.checksums = {item.request_id: item.checksum for item in order.items if item.samples}
        report.issues = self.fake.issues[num_issues:]
        report.errors_by_request = Counter(self.fake.errors_by_request) - before
        return ok

    def finish(self, order: FinishedOrder) -> dict[int, HookResult]:
        """`get_finished` on this rank's workers (rank -> (ok, answer)), then the fake engine's
        rewinds of rejected drafts and its forgetting of requests that are over. With
        `order.prefix_loads`, `get_finished_prefix_loads` follows (`prefix_answers` keeps them)."""
        answers = self.driver.get_finished(order.saving, order.loading)
        self.prefix_answers = self.driver.get_finished_prefix_loads() if order.prefix_loads else {}
        for request_id, length in order.rewinds.items():
            self.fake.rewind(request_id, length)
        for request_id in order.forgotten:
            self.fake.forget(request_id)
        return answers
