"""Attaching a connector to rank 0's engine: its options and hooks checked, its scheduler side and
this process's workers constructed (`rank_pass.WorkerFactory`), the layout registered, then
`wait_for_initialization` and the warm-up."""

from __future__ import annotations

import time

from kvtool.connector.api import KvCacheConnectorScheduler, KvCacheConnectorWorker
from kvtool.connector.loader import ConnectorSpec
from kvtool.connector.options import check_options, declared_options
from kvtool.connector.raised import describe_construction_error, describe_error, stops_kvtool
from kvtool.connector.runtime import ConnectorRuntime, require_grouped_hooks
from kvtool.engine.engine_config import EngineConfig
from kvtool.engine.pass_driver import PassDriver, RankWorker
from kvtool.engine.rank_pass import WorkerFactory
from kvtool.engine.runtimes.profile import RuntimeProfile
from kvtool.engine.worker_setup import rank_llm_args
from kvtool.errors import ConnectorError, ConstructionError, InputError
from kvtool.manager.manager import KvCacheManager


def attach_connector(spec: ConnectorSpec, options: dict[str, str], manager: KvCacheManager, config: EngineConfig,
                     driver: PassDriver, num_local_ranks: int, profile: RuntimeProfile) -> ConnectorRuntime:
    """The connector's runtime, its workers (ranks 0..num_local_ranks-1) handed to `driver`, each
    registered as `profile`'s runtime registers it. InputError or ConstructionError, naming the
    connector, when any step fails."""
    declared = declared_options(spec.scheduler_class)
    if declared is not None:
        check_options(spec.name, declared, options)
    try:
        require_grouped_hooks(spec.scheduler_class, len(manager.layer_groups))
    except ConnectorError as exc:
        raise InputError(f"connector {spec.name!r}: {exc}") from None
    factory = WorkerFactory(spec, options, manager, config.num_ranks, config.tp_size,
                            registration=profile.registration, use_kv_cache_manager_v2=profile.use_kv_cache_manager_v2)
    scheduler, workers = _construct(factory, manager, config, num_local_ranks)
    driver.workers = [_ready(factory, rank, worker) for rank, worker in enumerate(workers)]
    runtime = ConnectorRuntime(scheduler, workers, config.num_ranks, flat_hooks=profile.flat_hooks,
                               refuse_zero_async=profile.refuses_zero_async,
                               calls_cancel_load=profile.calls_cancel_load, past_the_prompt=profile.past_the_prompt)
    ok, _ = runtime.call("wait_for_initialization", scheduler.wait_for_initialization)
    if not ok:
        raise InputError(f"connector {spec.name!r}: {runtime.failures[-1].describe()}")
    if config.warmup_seconds > 0:
        time.sleep(config.warmup_seconds)
    return runtime


def _construct(factory: WorkerFactory, manager: KvCacheManager, config: EngineConfig,
               num_local_ranks: int) -> tuple[KvCacheConnectorScheduler, list[KvCacheConnectorWorker]]:
    """The scheduler side (rank 0's arguments), then every local rank's worker."""
    spec = factory.spec
    building = spec.scheduler_class
    try:
        scheduler = building(rank_llm_args(manager, spec, factory.options, 0, config.num_ranks, config.tp_size,
                                           factory.use_kv_cache_manager_v2))
        building = spec.worker_class
        return scheduler, [factory.construct(rank) for rank in range(num_local_ranks)]
    except InputError as exc:
        raise ConstructionError(f"connector {spec.name!r} could not be constructed: {exc}") from None
    except BaseException as exc:  # noqa: BLE001 - a constructor failure is the connector's (native panics too)
        if stops_kvtool(exc):
            raise
        raise ConstructionError(f"connector {spec.name!r} could not be constructed: "
                                f"{describe_construction_error(exc, building)}") from None


def _ready(factory: WorkerFactory, rank: int, worker: KvCacheConnectorWorker) -> RankWorker:
    """`factory.ready`, its failure said as an InputError naming the connector."""
    name = factory.spec.name
    try:
        return factory.ready(rank, worker)
    except ConnectorError as exc:
        raise InputError(f"connector {name!r}: {exc}") from None
    except BaseException as exc:  # noqa: BLE001 - native panics too
        if stops_kvtool(exc):
            raise
        raise InputError(f"connector {name!r}: registering the KV cache failed: {describe_error(exc)}") from None
