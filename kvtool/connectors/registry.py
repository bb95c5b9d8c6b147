"""The built-in connectors by name, and `load_connector` that knows them."""

from __future__ import annotations

from types import MappingProxyType

from kvtool.connector import loader
from kvtool.connector.loader import ConnectorSpec
from kvtool.connectors.disk import DiskConnectorScheduler, DiskConnectorWorker
from kvtool.connectors.host import (
    HostConnectorScheduler,
    HostConnectorWorker,
    ReservingHostScheduler,
    ReservingHostWorker,
)
from kvtool.connectors.index import IndexConnectorScheduler, IndexConnectorWorker
from kvtool.connectors.mooncake_connector import (
    MooncakeConnectorScheduler,
    MooncakeConnectorWorker,
    MooncakeIndexConnectorScheduler,
    MooncakeIndexConnectorWorker,
)
from kvtool.connectors.redis_connector import (
    RedisConnectorScheduler,
    RedisConnectorWorker,
    RedisIndexConnectorScheduler,
    RedisIndexConnectorWorker,
)
from kvtool.connectors.stacked import StackedIndexScheduler, StackedIndexWorker


def _builtin(name: str, scheduler: type, worker: type, mode: str) -> tuple[str, ConnectorSpec]:
    return name, ConnectorSpec(name, scheduler, worker, scheduler.__module__, MappingProxyType({"mode": mode}))


BUILTIN_CONNECTORS = MappingProxyType(dict([
    _builtin("host", HostConnectorScheduler, HostConnectorWorker, "sync"),
    _builtin("host-async", HostConnectorScheduler, HostConnectorWorker, "async"),
    _builtin("host-layerwise", HostConnectorScheduler, HostConnectorWorker, "layerwise"),
    _builtin("host-reserve", ReservingHostScheduler, ReservingHostWorker, "sync"),
    _builtin("disk", DiskConnectorScheduler, DiskConnectorWorker, "sync"),
    _builtin("index", IndexConnectorScheduler, IndexConnectorWorker, "sync"),
    _builtin("redis", RedisConnectorScheduler, RedisConnectorWorker, "sync"),
    _builtin("redis-index", RedisIndexConnectorScheduler, RedisIndexConnectorWorker, "sync"),
    _builtin("mooncake", MooncakeConnectorScheduler, MooncakeConnectorWorker, "sync"),
    _builtin("mooncake-index", MooncakeIndexConnectorScheduler, MooncakeIndexConnectorWorker, "sync"),
    _builtin("stacked-index", StackedIndexScheduler, StackedIndexWorker, "sync"),
]))


def load_connector(target: str, compat: str | None = None) -> ConnectorSpec:
    """A built-in by name, or `MODULE:SCHED:WORKER` / `path/to/file.py:SCHED:WORKER` imported
    (after `--compat`'s modules, e.g. TensorRT-LLM's for a connector written against it)."""
    return loader.load_connector(target, BUILTIN_CONNECTORS, compat)
