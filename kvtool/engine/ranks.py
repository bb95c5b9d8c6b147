"""Ranks as processes: rank 0 runs the scheduler, the manager and the connector's scheduler side;
ranks 1..N-1 are follower processes joined in a `torch.distributed` group (gloo on CPU, NCCL for
GPU pools), each with its own KV pools (its tensor-parallel shard), its own fake engine and its own
connector worker.

Each iteration rank 0 broadcasts a `PassOrder` (the connector metadata, the pass items and plan,
the byte operations its manager did on pages) when there is a pass to run, and a `FinishedOrder`
(the ids given to `get_finished`) at the end of every iteration (`rank_orders`); every rank runs
the same `RankPass` on its own shard; after each order rank 0 gathers one `RankReport` per follower
(`rank_group.ProcessRankGroup` is rank 0's side of this exchange). The runtime acts on a finished
id only once every rank reported it. Collectives run under a timeout, and a follower that dies or
hangs ends the run with one line naming the rank and its last hook.
"""

from __future__ import annotations

import ctypes
import datetime
import multiprocessing
import os
import pickle
import threading
import time
from dataclasses import replace
from typing import Any

import torch

from kvtool.connector.raised import describe_construction_error, describe_error, format_error, stops_kvtool
from kvtool.connector.rank_context import set_process_rank
from kvtool.connector.runtime import HOOK_FAILED, HookResult
from kvtool.engine.fake_engine import FakeEngine
from kvtool.engine.pass_driver import PassDriver
from kvtool.engine.pass_types import KvBytesModel
from kvtool.engine.rank_orders import FinishedOrder, PassOrder, RankReport, RankSetup, rank_manager_config
from kvtool.engine.rank_pass import RankPass, WorkerFactory
from kvtool.engine.worker_setup import forward_stream
from kvtool.errors import ConnectorError
from kvtool.manager.manager import KvCacheManager
from kvtool.models import heads_across_ranks

HOOK_NAME_BYTES = 1024
"""A follower's shared note: the hook it is in, or why its setup failed (said by rank 0)."""


class RankGroupError(ConnectorError):
    """A follower rank died, hung or could not start."""


# ---- rank 0's side ---------------------------------------------------------------------------
class Followers:
    """Ranks 1..N-1 as processes, seen from rank 0."""

    def __init__(self, setup: RankSetup) -> None:
        self.setup = setup
        self._closed = False
        mp = multiprocessing.get_context("spawn")
        self._hooks = [mp.Array(ctypes.c_char, HOOK_NAME_BYTES) for _ in range(setup.num_ranks)]
        self._processes = []
        try:
            store = _rendezvous_store(setup)
            setup = self.setup = replace(setup, port=store.port)
            pickled = pickle.dumps(setup)           # unpickled inside `follow`, where a failure is caught
            for rank in range(1, setup.num_ranks):
                process = mp.Process(target=follow, args=(rank, pickled, self._hooks[rank]), daemon=True)
                process.start()
                self._processes.append(process)      # only started ones: close() joins them
            self._await_followers(store)
            self._join_group(store)
        except RankGroupError:
            raise
        except Exception as exc:  # noqa: BLE001 - a group that cannot form is one line
            if any(not process.is_alive() for process in self._processes):
                raise self._gone() from None          # ended after its mark: its note says why
            self.close(force=True)
            raise RankGroupError(f"the {setup.num_ranks} ranks could not form a process group: {exc}") from None

    def _await_followers(self, store) -> None:
        """Return once every follower has reached the rendezvous; RankGroupError as soon as one has
        ended instead (the process group itself would wait the whole timeout for it)."""
        keys = [_joined_key(rank) for rank in range(1, self.setup.num_ranks)]
        deadline = time.monotonic() + self.setup.timeout_s
        while not store.check(keys):
            if any(not process.is_alive() for process in self._processes):
                raise self._gone()
            if time.monotonic() > deadline:
                late = [rank for rank in range(1, self.setup.num_ranks) if not store.check([_joined_key(rank)])]
                stage = self._hooks[late[0]].value.decode(errors="replace") or "starting"
                self.close(force=True)
                raise RankGroupError(f"rank {late[0]} did not start within {self.setup.timeout_s:g} s (in {stage})")
            time.sleep(0.02)

    def _join_group(self, store) -> None:
        """Rank 0's `init_process_group`, watching the followers meanwhile: one that reached the
        rendezvous and then ended (its own init failed) is named at once, where the group would
        wait the whole timeout for it. The join runs on a daemon thread; given up on, it is left
        to end with the timeout, leaving the group if it formed after all (`_join_reporting`), and
        this process can form another group at once (`_forget_abandoned_join`)."""
        outcome: list[BaseException | None] = []
        abandoned = threading.Event()
        joiner = threading.Thread(target=_join_reporting, args=(self.setup, store, outcome, abandoned), daemon=True,
                                  name="kvtool-rank0-join")
        joiner.start()
        while joiner.is_alive():
            joiner.join(0.05)
            if joiner.is_alive() and any(not process.is_alive() for process in self._processes):
                abandoned.set()
                _forget_abandoned_join()
                raise self._gone()
        if outcome[0] is not None:
            raise outcome[0]

    def broadcast(self, order: PassOrder | FinishedOrder) -> None:
        """Send `order` to every follower (rank 0 then runs its own pass, and `gather`s).
        RankGroupError naming the rank when one is gone."""
        import torch.distributed as dist
        try:
            dist.broadcast_object_list([order], src=0)
        except Exception:  # noqa: BLE001 - any transport error means a follower is gone
            raise self._gone() from None

    def gather(self) -> list[RankReport]:
        """One report per follower, rank 1 first."""
        import torch.distributed as dist
        reports: list[Any] = [None] * self.setup.num_ranks
        try:
            dist.all_gather_object(reports, None)   # all_gather: gather_object is not on every backend
        except Exception:  # noqa: BLE001
            raise self._gone() from None
        return reports[1:]

    def _gone(self) -> RankGroupError:
        """The error naming the follower that died, or the one still inside a hook (hung)."""
        error = None
        for rank, process in enumerate(self._processes, start=1):
            process.join(0.5)
            hook = self._hooks[rank].value.decode(errors="replace")
            if not process.is_alive():
                error = RankGroupError(f"rank {rank} ended (exit code {process.exitcode}) during {hook or 'setup'}")
                break
            if hook and error is None:
                error = RankGroupError(f"rank {rank} did not answer within {self.setup.timeout_s:g} s (in {hook})")
        self.close(force=True)
        return error or RankGroupError(f"a rank did not answer within {self.setup.timeout_s:g} s")

    def close(self, force: bool = False) -> None:
        """Tell the followers to stop (or kill them) and leave the process group."""
        import torch.distributed as dist
        if self._closed:
            return
        self._closed = True
        if not force and dist.is_initialized():
            try:
                dist.broadcast_object_list([None], src=0)
            except Exception:  # noqa: BLE001 - stopping anyway
                force = True
        for process in self._processes:
            process.join(None if not force else 0.1)
            if process.is_alive():
                process.kill()
                process.join()
        with _GROUP_LOCK:
            if dist.is_initialized():
                dist.destroy_process_group()


def _rendezvous_store(setup: RankSetup):
    """Rank 0's rendezvous server, bound to a port the OS picks and held from then on: a port
    picked, released and bound later could be taken meanwhile (validate --jobs runs several
    multi-rank scenarios at once)."""
    import torch.distributed as dist
    return dist.TCPStore("127.0.0.1", 0, setup.num_ranks, is_master=True,
                         timeout=datetime.timedelta(seconds=setup.timeout_s), wait_for_workers=False)


def _init_group(rank: int, setup: RankSetup, store=None) -> None:
    """Join the group: rank 0 through its own `store`, the followers at `setup.port`."""
    import torch.distributed as dist
    backend = "nccl" if setup.device == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())   # one GPU per rank
    timeout = datetime.timedelta(seconds=setup.timeout_s)
    if store is None:
        store = dist.TCPStore("127.0.0.1", setup.port, setup.num_ranks, is_master=False, timeout=timeout)
        store.set(_joined_key(rank), "1")
    dist.init_process_group(backend, store=store, rank=rank, world_size=setup.num_ranks, timeout=timeout)


_GROUP_LOCK = threading.Lock()
"""Held to leave the process group: by `Followers.close` and by a join thread given up on, which
may both find it formed."""


def _join_reporting(setup: RankSetup, store, outcome: list, abandoned: threading.Event) -> None:
    """Rank 0's `_init_group`, on `Followers._join_group`'s thread: appends what it raised, or None.
    Once `abandoned`, a group that formed all the same is left at once (nobody else would)."""
    import torch.distributed as dist
    try:
        _init_group(0, setup, store)
    except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
        outcome.append(exc)
        return
    outcome.append(None)
    with _GROUP_LOCK:
        if abandoned.is_set() and dist.is_initialized():
            dist.destroy_process_group()


def _forget_abandoned_join() -> None:
    """Let this process form a group again while an abandoned join is still blocked. The join
    took the default group's name from torch's count of groups (`_world.group_count`, private):
    left at 1, the next rank 0 would wait on other store keys than its fresh followers, which
    count from 0, until the timeout. Leaving a formed group resets the count the same way."""
    from torch.distributed import distributed_c10d
    world = getattr(distributed_c10d, "_world", None)
    if world is not None and hasattr(world, "group_count") and not distributed_c10d.is_initialized():
        world.group_count = 0


def _joined_key(rank: int) -> str:
    return f"kvtool/rank-joined/{rank}"


# ---- a follower ------------------------------------------------------------------------------
def follow(rank: int, pickled_setup: bytes, hook_name) -> None:
    """A follower's whole life: build the rank, then run every order rank 0 broadcasts. The setup
    comes pickled so that a connector this process cannot import is said by rank 0 in one line."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    setup = None
    try:
        hook_name.value = b"importing the connector"
        setup = pickle.loads(pickled_setup)
        hook_name.value = b"joining rank 0"
        _init_group(rank, setup)
        hook_name.value = b"building its pools"
        executor = RankExecutor(rank, setup, hook_name)
    except BaseException as exc:  # noqa: BLE001 - rank 0 says why in one line, no traceback here
        if stops_kvtool(exc):
            raise
        _note_setup_failure(hook_name, setup, exc)
        os._exit(1)
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        order = box[0]
        if order is None:
            break
        report = executor.run(order)
        dist.all_gather_object([None] * setup.num_ranks, report)
    dist.destroy_process_group()
    os._exit(0)


def _note_setup_failure(hook_name, setup: RankSetup | None, exc: BaseException) -> None:
    """Append why the rank could not be built to its shared hook note, which rank 0 reads when it
    finds the rank gone (`Followers._gone`)."""
    stage = hook_name.value.decode(errors="replace")
    worker_class = setup.spec.worker_class if setup is not None and setup.spec is not None else None
    reason = (describe_construction_error(exc, worker_class) if stage == "constructing the worker" and worker_class
              else describe_error(exc))
    hook_name.value = f"{stage or 'setup'}: {reason}".encode()[:HOOK_NAME_BYTES - 1]


class RankExecutor:
    """One follower rank: its pools (shard), and the same `RankPass` as rank 0 runs (its fake
    engine, its connector worker built by the same `WorkerFactory`); rank 0's page operations are
    replayed on its shard before each order."""

    def __init__(self, rank: int, setup: RankSetup, hook_name=None) -> None:
        self.rank = rank
        set_process_rank(rank, setup.num_ranks)
        config = replace(rank_manager_config(setup.manager, setup.tp_size, rank),
                         num_slots_by_pool_group=setup.num_slots, device=setup.device)
        self.manager = KvCacheManager(config)
        fake = FakeEngine(self.manager.layout, self.manager.layer_groups, setup.seed,
                          model_heads=heads_across_ranks(config.model))
        self._hook_name = hook_name
        self._report = RankReport(rank)
        workers = []
        if setup.spec is not None:
            factory = WorkerFactory(setup.spec, dict(setup.options), self.manager, setup.num_ranks, setup.tp_size,
                                    self._enter, setup.registration, setup.use_kv_cache_manager_v2)
            workers.append(factory.ready(rank, factory.construct(rank)))
        driver = PassDriver(workers, fake.layer_ids, fake.forward_layer, forward_stream(self.manager.device),
                            self._call, self._enter)
        self.rank_pass = RankPass(rank, fake, driver)
        self._enter("")

    @property
    def fake(self) -> KvBytesModel:
        return self.rank_pass.fake

    @property
    def worker(self):
        workers = self.rank_pass.driver.workers
        return workers[0].worker if workers else None

    def _enter(self, hook: str) -> None:
        if self._hook_name is not None:
            self._hook_name.value = hook.encode()[:HOOK_NAME_BYTES - 1]

    def run(self, order: PassOrder | FinishedOrder) -> RankReport:
        self._report = report = RankReport(self.rank)
        self.manager.replay_page_ops(order.page_ops)
        if isinstance(order, FinishedOrder):
            report.finished = self.rank_pass.finish(order).get(self.rank, HOOK_FAILED)
            report.prefix_loads = self.rank_pass.prefix_answers.get(self.rank, HOOK_FAILED)
        else:
            self.rank_pass.run_pass(order, report)
        self._enter("")
        return report

    def _call(self, hook: str, fn, *args) -> HookResult:
        """The follower's hook guard: a failure goes into the report for rank 0, which fails the pass."""
        try:
            return HookResult(True, fn(*args))
        except BaseException as exc:  # noqa: BLE001 - reported to rank 0 (sys.exit, native panics too)
            if stops_kvtool(exc):
                raise
            self._report.failures.append((hook, describe_error(exc)))
            self._report.tracebacks.append(format_error(exc))
            return HOOK_FAILED
