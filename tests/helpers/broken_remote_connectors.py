"""Remote connectors written the obvious way, and wrong: the ask only checks that blocks exist,
the load fetches them. When the server loses a block in between, the load fills the page with
zeros (what a connector that ignores a failed GET does). The remote scenarios must catch it."""

from __future__ import annotations

from kvtool.connectors.mooncake_connector import MooncakeConnectorScheduler, MooncakeConnectorWorker
from kvtool.connectors.redis_connector import RedisConnectorScheduler, RedisConnectorWorker


class _FetchesAtLoad:
    def secure(self, plan):
        return plan                       # the locations stay (key, group): nothing is fetched

    def pin(self, location):
        pass

    def unpin(self, location):
        pass


class _LoadsWhatItFetches:
    def load(self, transfers, layer_id=None):
        def read(batch):
            fetched = self.store.fetch([t.location for t in batch])
            return [fetched[t.location].payloads[0] if fetched[t.location] is not None
                    else bytes(self.layout.group(t.layer_group_id).bytes_per_page) for t in batch]
        self.load_payloads(transfers, layer_id, read)


class FetchAtLoad(_FetchesAtLoad, RedisConnectorScheduler):
    pass


class FetchAtLoadWorker(_LoadsWhatItFetches, RedisConnectorWorker):
    pass


class MooncakeFetchAtLoad(_FetchesAtLoad, MooncakeConnectorScheduler):
    pass


class MooncakeFetchAtLoadWorker(_LoadsWhatItFetches, MooncakeConnectorWorker):
    pass
