"""Running scenarios: each in its own process (see `processes`), in a fresh working directory,
under a timeout, so a connector that hangs or crashes is reported instead of waited on; one after
another, or several at once (`run_all`'s `jobs`), reported in the same order either way."""

from __future__ import annotations

import gc
import os
import pickle
import tempfile
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, replace
from multiprocessing.connection import wait

import torch

from kvtool.connector.compat import install_compat
from kvtool.connector.raised import describe_error, format_error
from kvtool.connector.store_namespace import store_namespace
from kvtool.engine.runtimes import profile_of
from kvtool.manager.layer_groups import plan_layer_groups
from kvtool.manager.pool_groups import placed_bytes, plan_pool_groups
from kvtool.models import load_model
from kvtool.validate.cause_evidence import forget_engines
from kvtool.validate.harness import MAX_SLOTS, Context, NotRunHere, registration_error, take_tracebacks
from kvtool.validate.processes import scenario_processes, sleep_while_waiting_for_the_gpu
from kvtool.validate.results import CheckResult, Verdict
from kvtool.validate.scenarios import SCENARIOS
from kvtool.validate.user_store import engine_store_folders

SETUP = "setup"


def run_scenario(name: str, ctx: Context, collect: bool = True) -> list[CheckResult]:
    """One scenario, here, in a fresh temporary working directory; errors become ERROR results.
    `collect`: collect the scenario's garbage before returning (below), which a process that ends
    right after need not do."""
    started = time.perf_counter()
    here = os.getcwd()
    take_tracebacks()   # this scenario's only
    forget_engines()
    with tempfile.TemporaryDirectory(prefix="kvtool-validate-") as workdir, store_namespace(label="validate"):
        os.chdir(workdir)
        try:
            with engine_store_folders():   # a user-set store folder would outlive the scenario
                results = _run_here(name, ctx)
        except NotRunHere as exc:
            results = [CheckResult(name, ctx.model, "registration" if name == SETUP else "scenario", Verdict.SKIP,
                                   0.0, [str(exc)])]
        except Exception as exc:  # noqa: BLE001 - the scenario's failure is the finding
            error = describe_error(exc)
            results = [CheckResult(name, ctx.model, "scenario", Verdict.ERROR, 0.0, [error],
                                   [f"the scenario stopped: {error}\n{format_error(exc).rstrip()}"])]
        finally:
            os.chdir(here)
            # Engines hold reference cycles (callbacks into their owners), and the garbage collector
            # counts objects, not bytes: without this, in-process runs keep every scenario's pools
            # and connector stores alive (gigabytes after a dozen scenarios).
            if collect:
                gc.collect()
    seconds = round(time.perf_counter() - started, 3)
    for r in results:
        r.seconds = seconds
        r.runtime = str(ctx.runtime)
    _attach_tracebacks(results, take_tracebacks())
    return results


def run_seeds(name: str, ctx: Context, seeds: Sequence[int],
              started: Callable[[int], None] = lambda seed: None) -> list[CheckResult]:
    """`name` at each of `seeds` in turn, here, until a run fails: that run's results, else the
    first seed's; each result's `seed` says which. `started(seed)` is called before each run.
    Each run is as `run_scenario` makes it (its own folder, store namespace, collected garbage);
    what the connector keeps in its modules outlives it, which a fresh process at the failing
    seed tells apart (`explore`)."""
    first: list[CheckResult] | None = None
    for seed in seeds:
        started(seed)
        results = run_scenario(name, replace(ctx, seed=seed))
        for r in results:
            r.seed = seed
        if any(r.failed for r in results):
            return results
        first = first if first is not None else results
    return first or []


def _run_here(name: str, ctx: Context) -> list[CheckResult]:
    if name == SETUP:
        return _setup(ctx)
    scenario = SCENARIOS[name]
    if ctx.runtime not in scenario.runs_on:
        raise NotRunHere(f"not run under {ctx.runtime}: {scenario.not_here}")
    return scenario.run(ctx)


def _attach_tracebacks(results: list[CheckResult], tracebacks: list[str]) -> None:
    """The scenario's tracebacks go on its first result that did not pass, once; none are kept
    when every check passed (the failure hook-raises injects, say)."""
    first = next((r for r in results if r.verdict not in (Verdict.PASS, Verdict.SKIP)), None)
    if first is not None:
        first.tracebacks = [t for t in first.tracebacks if t not in tracebacks] + tracebacks


def _setup(ctx: Context) -> list[CheckResult]:
    """The registration check: FAIL when the connector cannot take this model's cache; SKIP (its
    model's scenarios not run) where the runtime refuses the model, or where the connector was
    written for another runtime and this one was not asked for by name (`--runtime`)."""
    assert ctx.spec is not None   # a scenario runs a connector
    foreign = profile_of(ctx.runtime).cannot_host(ctx.spec.scheduler_class, ctx.spec.worker_class)
    if foreign is not None and not ctx.runtime_chosen:
        raise NotRunHere(f"not run under {ctx.runtime}: {foreign} (--runtime {ctx.runtime} makes this a failure)")
    error = foreign or registration_error(ctx)
    return [CheckResult(SETUP, ctx.model, "registration", Verdict.FAIL if error else Verdict.PASS, 0.0,
                        [error] if error else ["the layout was accepted"])]


@dataclass(frozen=True)
class SeedStarted:
    """What a child running `run_seeds` sends as each seed's run starts (`time.monotonic()`)."""

    seed: int
    at: float


class ScenarioProcess:
    """`run_scenario` in a child process, started by the constructor; `result()` collects it. The
    timeout counts from the moment the process has started. With `seeds`, the child runs
    `run_seeds` instead, and each seed's run gets the timeout from its own start."""

    def __init__(self, name: str, ctx: Context, timeout: float, start_method: str | None = None,
                 seeds: Sequence[int] = ()) -> None:
        self.name, self.ctx, self.timeout = name, ctx, timeout
        self.seed: int | None = None
        """The seed whose run started last (`seeds` only)."""
        mp = scenario_processes(start_method)
        self.receive, send = mp.Pipe(duplex=False)
        # not a daemon: a scenario with several ranks starts its follower processes
        self.child = mp.Process(target=_child, args=(send, name, pickle.dumps(ctx), ctx.compat, tuple(seeds)),
                                daemon=False)
        self.answered_at: float | None = None
        """When its results arrived; None until then (or if they never do)."""
        self.results: list[CheckResult] | None = None
        self.hung_up = False
        """The child's end of the pipe closed (it ended) before its results came."""
        self.started = time.perf_counter()
        self.child.start()
        # Closed at once, before any other child is forked: the child's end must be the only one, so that
        # its death reads as end-of-file here rather than as a timeout.
        send.close()
        self.deadline = time.perf_counter() + timeout

    def ready(self) -> bool:
        """Whether `result()` would return at once: the results came, the child's end of the pipe
        closed, or the deadline passed. Reads, without waiting, what the child sent so far: a
        seed's start (`run_seeds`) moves the deadline to that start plus the timeout."""
        while self.results is None and not self.hung_up and self.receive.poll(0):
            try:
                message = self.receive.recv()
            except EOFError:
                self.hung_up = True
                break
            if isinstance(message, SeedStarted):
                late = max(0.0, time.monotonic() - message.at)   # how long it waited in the pipe
                self.seed, self.deadline = message.seed, time.perf_counter() + self.timeout - late
            else:
                self.results = message
        return self.results is not None or self.hung_up or time.perf_counter() >= self.deadline

    def result(self) -> list[CheckResult]:
        """Wait for the child's results until the deadline; a timeout or a dead child is an ERROR result.
        A child that sent its results is not waited for: it ends by itself within `EXIT_GRACE_S`
        (`ended` and `close` collect it, or kill it past that). On a GPU its last step, the driver
        tearing down its CUDA context, is slow enough that waiting for it held up the next scenario."""
        while not self.ready():
            self.receive.poll(max(0.0, self.deadline - time.perf_counter()))
        self.receive.close()
        if self.results is not None:
            self.answered_at = time.perf_counter()
            return self.results
        self.reap(1.0)
        seconds = round(time.perf_counter() - self.started, 3)
        why = (f"did not finish within {self.timeout:g} s (a connector hook hung?)"
               if self.child.exitcode in (None, -9) else
               f"the scenario's process died (exit code {self.child.exitcode})")
        return [CheckResult(self.name, self.ctx.model, "scenario", Verdict.ERROR, seconds, [why], seed=self.seed,
                            runtime=str(self.ctx.runtime))]

    def ended(self) -> bool:
        """Whether the child has ended (collected if so); one that answered more than `EXIT_GRACE_S`
        ago is killed first. Never waits for the child."""
        if self.answered_at is not None and time.perf_counter() > self.answered_at + EXIT_GRACE_S:
            self.reap(0.0)
        return not self.child.is_alive()

    def close(self, wait: bool = True) -> None:
        """End the child: one that answered is given what is left of its `EXIT_GRACE_S` (none
        unless `wait`); one that did not is killed at once."""
        grace = 0.0
        if wait and self.answered_at is not None:
            grace = max(0.0, self.answered_at + EXIT_GRACE_S - time.perf_counter())
        self.reap(grace)

    def reap(self, grace: float) -> None:
        """Wait up to `grace` seconds for the child to end, then kill it if it still runs."""
        self.child.join(grace)
        if self.child.is_alive():
            self.child.kill()
            self.child.join()


EXIT_GRACE_S = 10.0
"""How long a child that sent its results may take to end before it is killed. Its exit only
releases memory (on a GPU, its CUDA context); a healthy one ends well within this."""


def run_isolated(name: str, ctx: Context, timeout: float, start_method: str | None = None) -> list[CheckResult]:
    """`run_scenario` in a child process; a timeout or a dead child is an ERROR result.
    `start_method` defaults to forkserver where CUDA exists, fork elsewhere. Returns once the child
    has ended."""
    process = ScenarioProcess(name, ctx, timeout, start_method)
    try:
        return process.result()
    finally:
        process.close()


def _child(send, name: str, ctx_blob: bytes, compat: str | None, seeds: tuple[int, ...] = ()) -> None:
    # A forked child must not enter the OpenMP pool its parent may have started (it would hang);
    # with one thread torch runs everything inline. The scenarios are small.
    torch.set_num_threads(1)
    try:
        sleep_while_waiting_for_the_gpu()   # before anything uses CUDA: the flag is read when the context is made
        install_compat(compat)   # before the connector's classes are imported again by unpickling
        # no collection: this process ends at once (os._exit), its memory with it; on a GPU the
        # collection's finalizers (freeing pinned and device memory) took 0.6 s a process with 16
        # starting at once (results/h200-host-async-x10/startup-probe-16.log)
        ctx = pickle.loads(ctx_blob)
        if not seeds:
            send.send(run_scenario(name, ctx, collect=False))
            return
        # What the parent built (torch, kvtool, the connector's modules) is never garbage: out of the
        # collector's sight, each seed's collection (`run_seeds`) scans only that run's objects
        # (48 ms a run otherwise, a fifth of a small scenario).
        gc.freeze()
        send.send(run_seeds(name, ctx, seeds, started=lambda seed: send.send(SeedStarted(seed, time.monotonic()))))
    finally:
        send.close()
        os._exit(0)


@dataclass(frozen=True)
class Task:
    """One scenario (or the registration, `SETUP`) of one model."""

    index: int
    """Its place in the serial order: where its results are reported."""
    model: int
    """Its context's place in `run_all`'s contexts."""
    name: str
    alone: bool = False
    """It runs with no other task in flight (a scenario that disrupts the `--remote` server)."""


def plan(contexts: Sequence[Context], names: list[str]) -> list[Task]:
    """Every task in the serial order: each model's registration, then its scenarios in `names`' order,
    model after model."""
    tasks: list[Task] = []
    for model, ctx in enumerate(contexts):
        for name in [SETUP] + names:
            alone = name != SETUP and SCENARIOS[name].disrupts_remote and ctx.remote is not None
            tasks.append(Task(len(tasks), model, name, alone))
    return tasks


def next_task(pending: Sequence[Task], running: Collection[Task], registered: Collection[int]) -> Task | None:
    """The first of `pending` that may start beside `running`, or None. A model's scenarios wait for
    its registration to pass (`registered`: those models); a task that must run alone starts only
    when nothing runs, and nothing starts beside it. With nothing ever running beside the next task
    (one job), this is the serial order."""
    if any(task.alone for task in running):
        return None
    for task in pending:
        if (task.name == SETUP or task.model in registered) and not (task.alone and running):
            return task
    return None


class Schedule:
    """The bookkeeping of a run of `tasks` (no processes): which may start, and their results in the
    serial order as soon as every earlier task's are in."""

    def __init__(self, tasks: list[Task]) -> None:
        self.pending = list(tasks)
        self.running: set[Task] = set()
        self.registered: set[int] = set()
        self._results: dict[int, list[CheckResult] | None] = {}   # None: dropped, nothing to report
        self._reported = 0
        self._size = len(tasks)

    @property
    def done(self) -> bool:
        return not self.pending and not self.running

    def take(self) -> Task | None:
        """The next task to start (`next_task`), now counted as running."""
        task = next_task(self.pending, self.running, self.registered)
        if task is not None:
            self.pending.remove(task)
            self.running.add(task)
        return task

    def finish(self, task: Task, results: list[CheckResult]) -> list[list[CheckResult]]:
        """Record `task`'s results; a registration that did not pass (failed, or skipped: the runtime
        refuses the model) drops its model's other tasks. Returns the result lists that became
        reportable, in the serial order."""
        self.running.discard(task)
        self._results[task.index] = results
        if task.name == SETUP and not any(r.verdict is Verdict.PASS for r in results):
            for dropped in [t for t in self.pending if t.model == task.model]:
                self.pending.remove(dropped)
                self._results[dropped.index] = None
        elif task.name == SETUP:
            self.registered.add(task.model)
        return self._reportable()

    def _reportable(self) -> list[list[CheckResult]]:
        ready = []
        while self._reported < self._size and self._reported in self._results:
            ready.append(self._results[self._reported])
            self._reported += 1
        return [results for results in ready if results is not None]


def max_jobs(num_ranks: int = 1) -> int:
    """How many scenarios may run at once on this machine: one process per CPU it may use, a
    scenario being `num_ranks` processes (at least 1)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cpus // num_ranks)


SCENARIO_GPU_OVERHEAD_BYTES = 1 << 30
"""A scenario process's GPU memory besides its pools: the CUDA context, PyTorch's and cuBLAS's
workspaces, a transfer backend's staging buffers. An estimate rounded up, not a measurement."""


def gpu_jobs_cap(models: Sequence[str], tokens_per_block: int, num_ranks: int, free_bytes: int) -> int:
    """How many scenarios fit `free_bytes` of GPU memory at once (at least 1): each is `num_ranks`
    processes, each with `SCENARIO_GPU_OVERHEAD_BYTES` and the pools of the largest of `models` at
    `harness.MAX_SLOTS` slots per pool group. Conservative: every rank counted on this one GPU
    with its model unsharded."""
    pool_groups = [plan_pool_groups(plan_layer_groups(load_model(m), tokens_per_block)) for m in models]
    pools = max(placed_bytes(groups, [MAX_SLOTS] * len(groups)) for groups in pool_groups)
    return max(1, free_bytes // ((SCENARIO_GPU_OVERHEAD_BYTES + pools) * num_ranks))


def run_all(contexts: Iterable[Context], names: list[str], timeout: float, isolated: bool = True,
            on_result: Callable[[list[CheckResult]], None] | None = None, jobs: int = 1,
            overlap: bool = True, seeds: Sequence[int] = ()) -> list[CheckResult]:
    """Registration first for each model; a model whose layout the connector refuses runs nothing else.
    Results, and the calls of `on_result`, come in the serial order (`plan`) whatever `jobs` is.
    With `seeds`, each scenario (not the registration) runs at those seeds one after another in
    its one process, until one fails (`run_seeds`): its results are that seed's, else the first's.

    `jobs` > 1 (isolated only) runs up to that many scenario processes at once, each exactly as
    `run_isolated` runs one, and so as isolated as a serial one: its own process (fork or fork-server
    child: its own connector objects, module state and environment), its own temporary working
    folder (a disk store there) and its own store namespace (`run_scenario`), its own timeout counted
    from its own start, its own results (tracebacks travel in them; files are written afterwards, by
    the caller). Follower ranks (`--num-ranks`) rendezvous on a port the OS gave the scenario's rank 0
    and that it holds from then on (`ranks._rendezvous_store`). With `--remote`, the scenarios that
    disrupt that server run alone (`next_task`). What they share is the machine (CPUs, memory, a
    GPU: wall-clock limits such as `--timeout` and `--load-timeout` feel the contention) and the
    terminal (what connectors print may interleave)."""
    contexts = list(contexts)
    if jobs > 1 and not isolated:
        raise ValueError("scenarios run in this process run one at a time (jobs=1)")
    schedule = Schedule(plan(contexts, names))
    everything: list[CheckResult] = []

    def report(ready: list[list[CheckResult]]) -> None:
        for results in ready:
            everything.extend(results)
            if on_result:
                on_result(results)

    if isolated:
        _run_processes(schedule, contexts, timeout, jobs, report, overlap, seeds)
    else:
        while (task := schedule.take()) is not None:
            ctx = contexts[task.model]
            results = run_seeds(task.name, ctx, seeds) if seeds and task.name != SETUP else run_scenario(task.name, ctx)
            report(schedule.finish(task, results))
    return everything


def _run_processes(schedule: Schedule, contexts: list[Context], timeout: float, jobs: int,
                   report: Callable[[list[list[CheckResult]]], None], overlap: bool = True,
                   seeds: Sequence[int] = ()) -> None:
    """Keep up to `jobs` scenario processes running until the schedule is done. Every process is
    started from this thread (no fork while another thread holds a lock); any still running when
    this ends early (an interrupt, say) is killed. Those that answered may end beside the next
    scenarios; each is killed once `EXIT_GRACE_S` have passed since it answered (at once if this
    ends early), so every one has ended when this returns. Without `overlap`, none is started
    until those have ended (each waited for up to its grace): for a connector holding a fixed
    port or lock until its process exits."""
    flight: dict[Task, ScenarioProcess] = {}
    ending: list[ScenarioProcess] = []     # answered, their processes not yet ended
    completed = False
    try:
        while not schedule.done:
            if not overlap:
                for process in ending:
                    process.close()
                ending = []
            while len(flight) < jobs and (task := schedule.take()) is not None:
                flight[task] = ScenarioProcess(task.name, contexts[task.model], timeout,
                                               seeds=seeds if task.name != SETUP else ())
            for task in _answered(flight):
                results = flight[task].result()      # still in `flight` until answered: an interrupt kills it
                ending.append(flight[task])
                del flight[task]
                report(schedule.finish(task, results))
            ending = [process for process in ending if not process.ended()]
        completed = True
    finally:
        for process in [*flight.values(), *ending]:
            process.close(wait=completed)


def _answered(flight: dict[Task, ScenarioProcess]) -> list[Task]:
    """Wait until a process in flight sent its results, ended or ran past its deadline; those tasks.
    A seed's start (`SeedStarted`) wakes this wait but answers nothing: it waits on."""
    while True:
        ready = [task for task, process in flight.items() if process.ready()]
        if ready:
            return ready
        soonest = min(process.deadline for process in flight.values())
        wait([process.receive for process in flight.values()], max(0.0, soonest - time.perf_counter()))
