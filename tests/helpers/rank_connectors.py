"""Connectors that go wrong on one rank only: what a multi-rank run must catch."""

from __future__ import annotations

import os

from kvtool.connectors.disk import DiskConnectorScheduler, DiskConnectorWorker
from kvtool.connectors.host import HostConnectorScheduler, HostConnectorWorker


class DiesOnRank1(HostConnectorWorker):
    """Rank 1 leaves its process in the first pass that loads."""

    def start_load_kv(self, stream):
        if self._llm_args.rank == 1 and self.meta.loads:
            os._exit(7)
        super().start_load_kv(stream)


class RaisesOnRank1(HostConnectorWorker):
    """Rank 1's start_load_kv raises whenever it loads: those passes fail on every rank."""

    def start_load_kv(self, stream):
        if self._llm_args.rank == 1 and self.meta.loads:
            raise RuntimeError("rank 1 cannot reach its store")
        super().start_load_kv(stream)


class ReadsRank0Files(DiskConnectorWorker):
    """Every rank reads the file the scheduler named (rank 0's shard): rank 1 loads rank 0's heads."""

    def _own(self, transfer):
        return transfer.location


__all__ = ["DiskConnectorScheduler", "HostConnectorScheduler"]
