"""host-async whose background saves land late, on a copy thread of its own started with the
worker (outside any hook: kvtool holds it only at its calls, through the gate, never task by task),
so the race of an H200 run stays a race on any machine: a save a second late (a quarter second
was overtaken on a loaded machine). (A thread of the connector's own, alive, keeps the runtime's
waits on the wall clock: `connector_clock`.)"""
import queue
import threading
import time
from concurrent.futures import Future

from kvtool.connectors.host import HostConnectorScheduler, HostConnectorWorker

SAVE_DELAY_S = 1.0


class SlowSaves(HostConnectorScheduler):
    pass


class SlowSavingWorker(HostConnectorWorker):
    def __init__(self, llm_args) -> None:
        super().__init__(llm_args)
        self._jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._copy_loop, daemon=True).start()

    def _background(self):
        return self

    def submit(self, copy, transfers) -> Future:
        """The executor's one method the host worker uses: the copy queued for the thread."""
        future: Future = Future()
        self._jobs.put((future, copy, transfers))
        return future

    def _copy_loop(self) -> None:
        while True:
            future, copy, transfers = self._jobs.get()
            if copy == self.save:
                time.sleep(SAVE_DELAY_S)
            try:
                future.set_result(copy(transfers))
            except BaseException as exc:   # noqa: BLE001 - the copy's failure is its future's
                future.set_exception(exc)
