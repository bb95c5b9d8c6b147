"""A connector module whose import hangs in any child process (a follower rank): its store client
blocks on a server only the launching process can reach."""

import multiprocessing
import time

from kvtool.connectors.host import HostConnectorScheduler, HostConnectorWorker

if multiprocessing.parent_process() is not None:
    time.sleep(60)


class Scheduler(HostConnectorScheduler):
    pass


class Worker(HostConnectorWorker):
    pass
