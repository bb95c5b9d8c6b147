"""What crosses between rank 0 and the other ranks: the setup a follower builds its rank from,
the orders rank 0 sends every rank (`PassOrder`, `FinishedOrder`) and the report each rank sends
back (`RankReport`). Plain data, so that a process group can pickle it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from kvtool.connector.loader import ConnectorSpec
from kvtool.connector.runtime import HOOK_FAILED, HookResult
from kvtool.engine.pass_driver import PassPlan
from kvtool.engine.pass_types import IntegrityIssue, PassItem
from kvtool.engine.runtimes.names import Registration
from kvtool.manager.config import KvCacheManagerConfig
from kvtool.models import shard_model


@dataclass(frozen=True)
class RankSetup:
    """What a follower needs to build its rank: the manager config of rank 0 (its model unsharded),
    the slots per pool group rank 0 got, the tensor-parallel size, the connector."""

    manager: KvCacheManagerConfig
    num_slots: tuple[int, ...]
    tp_size: int
    num_ranks: int
    seed: int
    spec: ConnectorSpec | None
    options: tuple[tuple[str, str], ...]
    port: int
    """Rank 0's rendezvous port: 0 until `Followers` binds one (the OS picks it)."""
    timeout_s: float
    device: str = "cpu"
    """Where rank 0's pools are ("cpu" or "cuda"): the followers' too, and the backend (gloo, NCCL)."""
    registration: Registration = Registration.LAYOUT
    """How every worker is handed its cache (the runtime profile's)."""
    use_kv_cache_manager_v2: bool = True
    """What the workers' `llm_args.kv_cache_config.use_kv_cache_manager_v2` says (the profile's)."""


def rank_manager_config(config: KvCacheManagerConfig, tp_size: int, rank: int) -> KvCacheManagerConfig:
    """Rank `rank`'s manager config: its shard of the model (the whole model where ranks only
    replicate, tp_size 1)."""
    if tp_size == 1:
        return config
    return replace(config, model=shard_model(config.model, tp_size, rank))


@dataclass
class PassOrder:
    """Everything a follower needs to run one pass exactly as rank 0 does (steps 1-2 of
    `pass_driver`)."""

    iteration: int
    metadata: Any
    items: list[PassItem]
    received: list[PassItem]
    page_ops: list[tuple]
    plan: PassPlan
    verify: list[PassItem] = field(default_factory=list)
    """Live requests' pages to verify after the pass, up to the history they had before it
    (rank 0's `verify_all_after_iteration`, on this rank's shard)."""


@dataclass
class FinishedOrder:
    """The end of an iteration on a follower (step 4 of `pass_driver`): the page operations since
    the pass, the requests to forget, and the ids `get_finished` is given."""

    page_ops: list[tuple]
    saving: list[int]
    loading: list[int]
    forgotten: list[int]
    rewinds: dict[int, int] = field(default_factory=dict)
    """Request id -> tokens it kept after a verify pass rejected drafts (the fake engine rewinds)."""
    prefix_loads: bool = False
    """Ask every worker `get_finished_prefix_loads` after `get_finished` (prefix reservations on)."""


@dataclass
class RankReport:
    rank: int
    failures: list[tuple[str, str]] = field(default_factory=list)
    """(hook, error) for each hook that raised."""
    tracebacks: list[str] = field(default_factory=list)
    """The whole traceback of each of `failures`, in the same order."""
    finished: HookResult = HOOK_FAILED
    """(get_finished ran without raising, what it returned); HOOK_FAILED for a pass order."""
    prefix_loads: HookResult = HOOK_FAILED
    """(get_finished_prefix_loads ran without raising, what it returned), where it was asked."""
    checksums: dict[int, int] = field(default_factory=dict)
    issues: list[IntegrityIssue] = field(default_factory=list)
    errors_by_request: Counter = field(default_factory=Counter)
