"""Asynchronous connectors whose background work runs late, for the tests that prove `kvtool
validate` holds that work to the latest point the contract allows (`engine.held_work`).

- `LateReader:LateReaderWorker`: host-async whose background load reads the metadata bound when
  its thread runs, not the loads it was handed when `start_load_kv` started it (the defect: by
  then the next pass's metadata may be bound).
- `PoolAsync:PoolAsyncWorker`: the same connector without the defect (host-async as shipped),
  and `SlowPoolAsync:SlowPoolAsyncWorker`, correct but every background copy 5 ms slower.
- `BlocksInGetFinished:ThreadWaitWorker`: correct; each load on a thread of its own, and
  `get_finished` waits for an event the thread sets (a wait kvtool cannot see).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace

from kvtool.connectors.host import HostConnectorScheduler, HostConnectorWorker
from kvtool.connectors.metadata import PageTransfer

SLOW_S = 0.005


def _async_args(llm_args):
    return replace(llm_args, connector_options={**llm_args.connector_options, "mode": "async"})


class PoolAsync(HostConnectorScheduler):
    """The host scheduler in async mode."""

    def __init__(self, llm_args) -> None:
        super().__init__(_async_args(llm_args))


class PoolAsyncWorker(HostConnectorWorker):
    """host-async as shipped: each background copy is handed the transfers of its pass."""

    def __init__(self, llm_args) -> None:
        super().__init__(_async_args(llm_args))


class LateReader(PoolAsync):
    pass


class LateReaderWorker(PoolAsyncWorker):
    """The defect: a background load copies the loads of whatever metadata is bound when it runs."""

    def _submit(self, futures: dict[int, Future], copy: Callable[[Sequence[PageTransfer]], None],
                by_request: dict[int, list[PageTransfer]]) -> None:
        if futures is not self._loading or not by_request:
            super()._submit(futures, copy, by_request)
            return
        future = self._background().submit(lambda: copy(self._bound_loads()))
        futures.update(dict.fromkeys(by_request, future))

    def _bound_loads(self) -> list[PageTransfer]:
        return [t for transfers in self.meta.async_loads.values() for t in transfers]


class SlowPoolAsync(PoolAsync):
    pass


class SlowPoolAsyncWorker(PoolAsyncWorker):
    """Correct, and every background copy SLOW_S slower (a slow tier)."""

    def load(self, transfers, layer_id=None):
        time.sleep(SLOW_S)
        super().load(transfers, layer_id)

    def save(self, transfers, layer_id=None):
        time.sleep(SLOW_S)
        super().save(transfers, layer_id)


class BlocksInGetFinished(PoolAsync):
    pass


class ThreadWaitWorker(PoolAsyncWorker):
    """Correct: a thread per background copy, and get_finished blocks on an event the copy sets
    for every id it is given whose copy is in flight."""

    def _submit(self, futures, copy, by_request) -> None:
        if not by_request:
            return
        future: Future = Future()
        landed = threading.Event()
        transfers = [t for ts in by_request.values() for t in ts]

        def run() -> None:
            copy(transfers)
            future.set_result(None)
            landed.set()

        future.landed = landed      # type: ignore[attr-defined]
        for earlier in list(self._saving.values()) + list(self._loading.values()):
            getattr(earlier, "landed", landed).wait()     # one copy at a time, in order
        threading.Thread(target=run, daemon=True).start()
        futures.update(dict.fromkeys(by_request, future))

    def get_finished(self, finished_gen_req_ids, started_loading_req_ids):
        for rid in list(finished_gen_req_ids) + list(started_loading_req_ids):
            for futures in (self._saving, self._loading):
                if rid in futures:
                    futures[rid].landed.wait()
        return super().get_finished(finished_gen_req_ids, started_loading_req_ids)
