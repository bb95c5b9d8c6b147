"""A connector module that imports only in the process that loaded it first: a follower rank (a
spawned process) cannot unpickle a worker class from it, as with a connector that reads a file or
a device only the launching process has."""

import multiprocessing

from kvtool.connectors.host import HostConnectorScheduler, HostConnectorWorker

if multiprocessing.parent_process() is not None:
    raise ImportError("main_process_only refuses a child process")


class Scheduler(HostConnectorScheduler):
    pass


class Worker(HostConnectorWorker):
    pass
