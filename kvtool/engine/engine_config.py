"""What an engine run is configured with (`EngineConfig`) and what it counts (`EngineStats`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvtool.engine.hold_policy import HoldPolicy
from kvtool.engine.pass_types import PassItem
from kvtool.engine.runtimes.names import DEFAULT_RUNTIME, RuntimeName
from kvtool.engine.scheduler import Batch, SchedulerConfig
from kvtool.manager.config import KvCacheManagerConfig
from kvtool.types import Fidelity


@dataclass(frozen=True)
class EngineConfig:
    manager: KvCacheManagerConfig
    scheduler: SchedulerConfig = SchedulerConfig()
    seed: int = 0
    runtime: RuntimeName = DEFAULT_RUNTIME
    """The TensorRT-LLM runtime the engine plays (`kvtool.engine.runtimes`): when the connector is
    asked, which pages back a first chunk, how workers register, what is refused at bring-up."""
    num_ranks: int = 1
    verify_all_after_iteration: bool = False
    max_transmission_iterations: int = 64
    max_transmission_seconds: float | None = None
    """When set, an asynchronous load fails after this many wall-clock seconds in transmission
    (instead of after `max_transmission_iterations` iterations: idle iterations take well under a
    millisecond, so counting them judges a slow store unfairly)."""
    max_saving_seconds: float | None = None
    """When set, a finished request whose asynchronous save (`request_finished` answered True)
    `get_finished` has not reported this many wall-clock seconds after it began fails, and its held
    pages are released (None: it holds them until the run ends)."""
    pad_generation_batch_to: int = 0
    """Pad generation batches with dummy requests up to this size (as CUDA-graph padding does)."""
    iteration_seconds: float = 0.01
    check_integrity_every_iteration: bool = False
    tp_size: int = 1
    """Tensor-parallel ranks: each rank's pools hold 1/tp_size of the KV heads (1: every rank
    holds them all)."""
    ranks_as_processes: bool = False
    """Ranks 1..num_ranks-1 run as processes in a torch.distributed group (see `ranks`); False:
    every rank's worker lives in this process and sees rank 0's pages."""
    process_group_of_one: bool = False
    """With one rank and `ranks_as_processes`, still form the torch.distributed group (of one) and
    run every collective: the NCCL path on a machine with one GPU."""
    rank_timeout_s: float = 60.0
    """How long a collective waits for a rank before the run ends naming it."""
    fidelity: Fidelity = Fidelity.BYTES
    """`bytes`: pools hold KV bytes the fake engine writes and verifies; `blocks`: virtual pools,
    nothing written or verified (see `no_bytes`), for a connector that moves no bytes; `tokens`:
    the tokens `bytes` would generate, nothing written or verified (`token_model`), for a run
    with no connector (a reference)."""
    forget_finished: bool = False
    """Drop a request's state once it is over (a long streamed replay); `states` then holds the
    live ones only."""
    iteration_time: Callable[[Batch, list[PassItem]], float] | None = None
    """Simulated seconds one iteration takes (a cost model); None: `iteration_seconds` each."""
    draft_tokens: int = 0
    """Draft tokens per generation step (speculative decoding; `kvtool.engine.drafts`); 0: off."""
    acceptance: float = 0.7
    """With drafts: the probability a draft is accepted, given the ones before it were."""
    gate_async_work: bool = False
    """kvtool decides when the connector's background work runs (`connector_work`): work it hands
    to a pool or a thread is held as `hold_policy` says, its other threads wait from a pass's first
    save hook until the reports of that iteration's `get_finished` are acted on: kvtool validate's
    deterministic races."""
    hold_policy: HoldPolicy = HoldPolicy()
    """With `gate_async_work`: how long each piece of background work is held (`hold_policy`)."""
    stream_races: bool = False
    """With `gate_async_work` on device pages: each layer's writes delayed on the forward stream and
    the connector's own streams spun at its load hooks (`stream_races`): kvtool validate's races of
    copies not ordered against the hooks' stream."""
    idle_wait_seconds: float = 0.0005
    """How long an iteration in which nothing ran waits for the connector's background work
    before `get_finished` is polled again."""
    warmup_seconds: float = 0.0
    """Wall-clock seconds between the connector's `wait_for_initialization` and the first pass,
    as TensorRT-LLM's executor warms up (a dummy pass, CUDA graph capture) before it serves: a
    connector that finishes its own setup in the background after registration (KVBM 1.6.1's
    leader builds its slot manager about 50 ms later, and panics on an ask before) is ready only
    with some. 0: the first request is asked at once, which finds such a race."""


@dataclass
class EngineStats:
    iterations: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    num_failed: int = 0
    num_finished: int = 0
    """Requests over (done or failed)."""
    num_deferrals: int = 0
    num_pauses: int = 0
    recomputed_tokens: int = 0
    """Tokens computed again after a pause (computed before it, neither reused nor loaded)."""
    failures: list[str] = field(default_factory=list)
