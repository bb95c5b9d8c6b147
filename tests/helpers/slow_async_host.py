"""host-async whose background saves land late: the race of an H200 run, made certain on any machine."""
import time

from kvtool.connectors.host import HostConnectorScheduler, HostConnectorWorker

SAVE_DELAY_S = 0.25


class SlowSaves(HostConnectorScheduler):
    pass


class SlowSavingWorker(HostConnectorWorker):
    def save(self, transfers, layer_id=None):
        time.sleep(SAVE_DELAY_S)
        super().save(transfers, layer_id)
