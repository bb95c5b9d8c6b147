"""Engines on the CPU with a scripted connector, for protocol tests."""

from __future__ import annotations

from kvtool.connector.loader import ConnectorSpec
from kvtool.engine.engine import Engine, EngineConfig
from kvtool.engine.runtimes import profile_of
from kvtool.engine.scheduler import SchedulerConfig
from kvtool.manager import KvCacheManagerConfig
from kvtool.models import load_model
from tests.helpers.connectors import OracleWorker, ScriptedScheduler


def scripted(answer, finish_async=False, worker=OracleWorker):
    sched = type("Sched", (ScriptedScheduler,), {"answer": staticmethod(answer), "finish_async": finish_async})
    return ConnectorSpec("scripted", sched, worker, "tests.helpers.connectors")


def make_engine(spec=None, model="tiny", num_slots=64, tpb=4, runtime=None, **kwargs):
    """`runtime`: the profile the engine plays (None: EngineConfig's default); a profile whose
    connectors run only under GUARANTEED_NO_EVICT (trtllm-v1) gets output reservation unless the
    test asks for `pause_to_grow` (MAX_UTILIZATION)."""
    options = {k: kwargs.pop(k) for k in list(kwargs)
               if k in ("max_batch_size", "max_num_tokens", "chunk_size", "local_reuse", "pause_to_grow")}
    if runtime is not None:
        kwargs["runtime"] = profile_of(runtime).name
        if profile_of(runtime).reserves_outputs and not options.get("pause_to_grow"):
            options["reserve_outputs"] = True
    scheduler = SchedulerConfig(**options)
    config = EngineConfig(KvCacheManagerConfig(load_model(model), tpb, num_slots=num_slots, device="cpu"),
                          scheduler, **{"check_integrity_every_iteration": True, "verify_all_after_iteration": True,
                                        **kwargs})
    engine = Engine(config, spec)
    if spec is not None:
        for worker in engine.connector.workers:
            worker.fake = engine.fake
    return engine


def sched(engine):
    return engine.connector.scheduler
