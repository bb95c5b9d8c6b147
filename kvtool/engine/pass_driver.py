"""One pass of the connector's worker hooks: the same code on rank 0 and on every follower rank.

An iteration, as TensorRT-LLM's executor runs it (overlap scheduler off):

1. when the scheduler scheduled requests: `build_connector_meta` (rank 0), the metadata bound to
   every worker, `start_load_kv` — also when every scheduled request left the batch to load
   asynchronously, since that is what starts the load;
2. when the batch still holds requests: the forward pass — per layer `wait_for_layer_load`, the
   layer, `save_kv_layer` — then the workers' forward-pass callables, then `wait_for_save`;
3. sampling, and `request_finished` for the requests that ended (rank 0, the engine's part);
4. `get_finished` on every rank, every iteration (then `get_finished_prefix_loads`, where the
   connector takes part in prefix reservations).

`PassPlan` says which of 1 and 2 run; `PassDriver.run_pass` runs them for the workers of one
process and `PassDriver.get_finished` runs 4. Hooks go through one guard (`call`), so a hook that
raises is recorded in the same words on every rank. A worker's hooks are bound once, when its rank
is set up (`WorkerHooks`): what watches them (the protocol bench's clocks, validate's injected
failure) is a `HookObserver` given to the driver, told before and after every guarded hook, never a
patched worker.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvtool.connector.api import KvCacheConnectorWorker
from kvtool.connector.raised import stops_kvtool
from kvtool.connector.rank_context import acting_as
from kvtool.connector.runtime import HookResult
from kvtool.engine.worker_setup import made_current
from kvtool.errors import ConnectorError

Call = Callable[..., HookResult]
"""`call(hook_label, fn, *args) -> (ok, result)`: runs a hook, records a failure, never raises."""


@dataclass(frozen=True)
class PassPlan:
    starts: bool
    """Requests were scheduled: `build_connector_meta` ran and `start_load_kv` runs."""
    forwards: bool
    """The batch holds requests once asynchronous loads left it: the forward pass runs."""


class HookObserver(Protocol):
    """Told around every guarded worker hook a driver runs (`start_load_kv`, `wait_for_layer_load`,
    `save_kv_layer`, the forward pass callable, `wait_for_save`, `get_finished`), inside the guard:
    what `before` raises is recorded as that hook's failure, and the hook does not run."""

    def before(self, hook: str, rank: int, args: tuple) -> None:
        """`hook` of `rank` is about to run with `args`."""

    def after(self, hook: str, rank: int) -> None:
        """`hook` of `rank` returned or raised."""


class _Unobserved:
    def before(self, hook: str, rank: int, args: tuple) -> None:
        pass

    def after(self, hook: str, rank: int) -> None:
        pass


UNOBSERVED: HookObserver = _Unobserved()


@dataclass(frozen=True)
class WorkerHooks:
    """A worker's pass hooks, bound once (a later change to the worker's attributes is not seen)."""

    bind_connector_meta: Callable[[Any], None]
    start_load_kv: Callable[..., Any]
    wait_for_layer_load: Callable[..., Any]
    save_kv_layer: Callable[..., Any]
    wait_for_save: Callable[..., Any]
    get_finished: Callable[..., Any]
    get_finished_prefix_loads: Callable[..., Any]

    @classmethod
    def of(cls, worker: KvCacheConnectorWorker) -> WorkerHooks:
        return cls(worker.bind_connector_meta, worker.start_load_kv, worker.wait_for_layer_load,
                   worker.save_kv_layer, worker.wait_for_save, worker.get_finished, worker.get_finished_prefix_loads)

    def named(self, hook: str) -> Callable[..., Any]:
        """The bound hook called `hook` (one of the fields: the frozen record, not the worker)."""
        return getattr(self, hook)


@dataclass
class RankWorker:
    """One rank's connector worker as a pass drives it, its hooks bound at construction."""

    rank: int
    worker: KvCacheConnectorWorker
    end_of_pass: Callable[[], None] | None = None
    hooks: WorkerHooks = field(init=False)

    def __post_init__(self) -> None:
        self.hooks = WorkerHooks.of(self.worker)

    def label(self, hook: str) -> str:
        return f"{hook} (rank {self.rank})"


def ask_end_of_pass(worker: KvCacheConnectorWorker, rank: int) -> Callable[[], None] | None:
    """The worker's `register_forward_pass_callable` answer, asked once at setup; ConnectorError
    when it raises or answers something that is neither None nor callable."""
    hook = f"register_forward_pass_callable (rank {rank})"
    try:
        with acting_as(rank):
            answer = worker.register_forward_pass_callable()
    except BaseException as exc:  # noqa: BLE001 - the connector's failure (native panics too), said in one line
        if stops_kvtool(exc):
            raise
        raise ConnectorError(f"{hook} raised {type(exc).__name__}: {exc}") from None
    if answer is not None and not callable(answer):
        raise ConnectorError(f"{hook} returned {answer!r}, which is neither None nor callable")
    return answer


class PassDriver:
    """The worker hooks of a pass around a fake forward, for the ranks living in one process."""

    def __init__(self, workers: Sequence[RankWorker], layer_ids: Sequence[int],
                 forward_layer: Callable[[int, list], None], stream, call: Call,
                 on_hook: Callable[[str], None] = lambda hook: None) -> None:
        self.workers = list(workers)
        self.layer_ids = list(layer_ids)
        self._forward_layer = forward_layer
        self.stream = stream
        self._call = call
        self._on_hook = on_hook
        """Told the hook about to run (a follower publishes it, to name a hang)."""
        self.observer: HookObserver = UNOBSERVED
        self._layer_done: Callable[[int], None] | None = None

    def observe(self, observer: HookObserver) -> None:
        """From now on `observer` is told around every guarded hook (replacing the one before)."""
        self.observer = observer

    def observe_layers(self, layer_done: Callable[[int], None]) -> None:
        """From now on `layer_done(layer_id)` is called right after each layer's forward is issued
        (replacing the one before): on GPU pages, with that layer's work queued on `stream`."""
        self._layer_done = layer_done

    def _forward(self, layer_id: int, items: list) -> None:
        self._forward_layer(layer_id, items)
        if self._layer_done is not None:
            self._layer_done(layer_id)

    def run_pass(self, plan: PassPlan, metadata: Any, items: list) -> bool:
        """Steps 1-2 of the module docstring; False at the first hook that raised (the rest of
        the pass is skipped). With no worker, only the forward runs."""
        if plan.starts:
            for rank_worker in self.workers:
                rank_worker.hooks.bind_connector_meta(metadata)
            if not self._each("start_load_kv", self.stream):
                return False
        if not plan.forwards:
            return True
        if not self.workers:   # no connector: every hook would answer at once; only the forward runs
            for layer_id in self.layer_ids:
                self._forward(layer_id, items)
            return True
        for layer_id in self.layer_ids:
            if not self._each("wait_for_layer_load", layer_id, self.stream):
                return False
            self._on_hook("forward")
            self._forward(layer_id, items)
            if not self._each("save_kv_layer", layer_id, self.stream):
                return False
        if not self._end_of_pass():
            return False
        return self._each("wait_for_save", self.stream)

    def get_finished(self, saving: list[int], loading: list[int]) -> dict[int, HookResult]:
        """Step 4: rank -> (ok, what its `get_finished(saving, loading)` returned)."""
        answers = {}
        for rank_worker in self.workers:
            self._on_hook("get_finished")
            with acting_as(rank_worker.rank):
                answers[rank_worker.rank] = self._call(
                    rank_worker.label("get_finished"),
                    self._observed("get_finished", rank_worker.rank, rank_worker.hooks.get_finished),
                    list(saving), list(loading))
        return answers

    def get_finished_prefix_loads(self) -> dict[int, HookResult]:
        """Prefix reservations: rank -> (ok, what its `get_finished_prefix_loads()` returned), after
        `get_finished`, every iteration."""
        answers = {}
        for rank_worker in self.workers:
            self._on_hook("get_finished_prefix_loads")
            with acting_as(rank_worker.rank):
                answers[rank_worker.rank] = self._call(
                    rank_worker.label("get_finished_prefix_loads"),
                    self._observed("get_finished_prefix_loads", rank_worker.rank,
                                   rank_worker.hooks.get_finished_prefix_loads))
        return answers

    def _each(self, hook: str, *args: Any) -> bool:
        ok = True
        for rank_worker in self.workers:
            self._on_hook(hook)
            with acting_as(rank_worker.rank):
                bound = self._observed(hook, rank_worker.rank, rank_worker.hooks.named(hook))
                ok &= self._call(rank_worker.label(hook), bound, *args)[0]
        return ok

    def _observed(self, hook: str, rank: int, bound: Callable[..., Any]) -> Callable[..., Any]:
        """`bound`, with the observer told around it (`bound` itself when nothing observes)."""
        observer = self.observer
        if observer is UNOBSERVED:
            return bound

        def observed(*args: Any) -> Any:
            observer.before(hook, rank, args)
            try:
                return bound(*args)
            finally:
                observer.after(hook, rank)
        return observed

    def _end_of_pass(self) -> bool:
        """The forward-pass callables, with the forward stream current."""
        ok = True
        with made_current(self.stream):
            for rank_worker in self.workers:
                if rank_worker.end_of_pass is not None:
                    self._on_hook("forward pass callable")
                    with acting_as(rank_worker.rank):
                        end_of_pass = self._observed("forward pass callable", rank_worker.rank,
                                                     rank_worker.end_of_pass)
                        ok &= self._call(rank_worker.label("forward pass callable"), end_of_pass)[0]
        return ok
