"""`mooncake` and `mooncake-index`: the remote tier (`remote_connector`) on Mooncake Store.

Options: `master` (default 127.0.0.1:50051), `metadata` (default http://127.0.0.1:8080/metadata),
`protocol` (tcp, rdma), `device`, `host`, `buffer`, `prefix`, `staging`, `retry_after`, `mode`,
`backend`.
"""

from __future__ import annotations

from kvtool.connectors.mooncake_store import MOONCAKE_OPTIONS, MooncakeBlockStore
from kvtool.connectors.remote_connector import (
    RemoteIndexScheduler,
    RemoteIndexWorker,
    RemoteStoreScheduler,
    RemoteStoreWorker,
)
from kvtool.connectors.store_scheduler import STORE_OPTIONS


class MooncakeConnectorScheduler(RemoteStoreScheduler):
    kvtool_options = STORE_OPTIONS + MOONCAKE_OPTIONS
    store_class = MooncakeBlockStore


class MooncakeConnectorWorker(RemoteStoreWorker):
    store_class = MooncakeBlockStore


class MooncakeIndexConnectorScheduler(RemoteIndexScheduler):
    kvtool_options = STORE_OPTIONS + MOONCAKE_OPTIONS
    store_class = MooncakeBlockStore


class MooncakeIndexConnectorWorker(RemoteIndexWorker):
    store_class = MooncakeBlockStore
