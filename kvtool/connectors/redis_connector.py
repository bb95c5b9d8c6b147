"""`redis` and `redis-index`: the remote tier (`remote_connector`) on a Redis server.

Options: `url` (default redis://127.0.0.1:6379/0; a URL holding a password is refused),
`password_env`, `ttl`, `prefix`, `timeout`, `staging`, `retry_after`, `mode`, `backend`.
"""

from __future__ import annotations

from kvtool.connectors.redis_store import REDIS_OPTIONS, RedisBlockStore
from kvtool.connectors.remote_connector import (
    RemoteIndexScheduler,
    RemoteIndexWorker,
    RemoteStoreScheduler,
    RemoteStoreWorker,
)
from kvtool.connectors.store_scheduler import STORE_OPTIONS


class RedisConnectorScheduler(RemoteStoreScheduler):
    kvtool_options = STORE_OPTIONS + REDIS_OPTIONS
    store_class = RedisBlockStore


class RedisConnectorWorker(RemoteStoreWorker):
    store_class = RedisBlockStore


class RedisIndexConnectorScheduler(RemoteIndexScheduler):
    kvtool_options = STORE_OPTIONS + REDIS_OPTIONS
    store_class = RedisBlockStore


class RedisIndexConnectorWorker(RemoteIndexWorker):
    store_class = RedisBlockStore
