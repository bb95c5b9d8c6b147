"""Connectors that go wrong on one rank only: what a multi-rank run must catch."""

from __future__ import annotations

import os
import time

from kvtool.connectors.disk import DiskConnectorScheduler, DiskConnectorWorker
from kvtool.connectors.host import (  # noqa: F401
    HostConnectorScheduler,
    HostConnectorWorker,
    ReservingHostScheduler,
    ReservingHostWorker,
)
from tests.helpers.broken_connectors import AsyncScheduler
from tests.helpers.broken_connectors import _async_args as async_args


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


class UnbuildableOnRank1(HostConnectorWorker):
    """Rank 1's worker cannot be constructed (its store is unreachable from there)."""

    def __init__(self, llm_args):
        if llm_args.rank == 1:
            raise ValueError("rank 1 has no store")
        super().__init__(llm_args)


class ReadsRank0Files(DiskConnectorWorker):
    """Every rank reads the file the scheduler named (rank 0's shard): rank 1 loads rank 0's heads."""

    def _own(self, transfer):
        return transfer.location


__all__ = ["AsyncScheduler", "DiskConnectorScheduler", "HostConnectorScheduler"]


class LoadsReportedOnRank0Only(HostConnectorWorker):
    """load-completes: only rank 0 ever reports its asynchronous loads finished."""

    def __init__(self, llm_args):
        super().__init__(async_args(llm_args))

    def get_finished(self, finished_gen_req_ids, started_loading_req_ids):
        saved, loaded = super().get_finished(finished_gen_req_ids, started_loading_req_ids)
        return saved, loaded if self._llm_args.rank == 0 else []


class OtherPlanOnRank1(HostConnectorWorker):
    """integrity: rank 1 builds another plan from the same metadata (each block into the next page)."""

    def load(self, transfers, layer_id=None):
        if self._llm_args.rank == 1 and transfers:
            pages = [t.page for t in transfers]
            transfers = [t._replace(page=pages[(i + 1) % len(pages)]) for i, t in enumerate(transfers)]
        super().load(transfers, layer_id)


class SaveNeverLandsOnRank1(HostConnectorWorker):
    """integrity: rank 1 reports its saves done like every rank, but never writes them."""

    def save(self, transfers, layer_id=None):
        if self._llm_args.rank != 1:
            super().save(transfers, layer_id)


class SlowRank1(HostConnectorWorker):
    """Correct, and slow on rank 1: it reports each finished save and load three calls later than it
    could. The runtime must wait for it (pages held, requests kept out of the batch)."""

    DELAY = 3

    def __init__(self, llm_args):
        super().__init__(async_args(llm_args))
        self._late: list[tuple[int, list[int], list[int]]] = []
        self.calls = 0

    def get_finished(self, finished_gen_req_ids, started_loading_req_ids):
        saved, loaded = super().get_finished(finished_gen_req_ids, started_loading_req_ids)
        if self._llm_args.rank != 1:
            return saved, loaded
        self.calls += 1
        self._late.append((self.calls + self.DELAY, saved, loaded))
        due = [entry for entry in self._late if entry[0] <= self.calls]
        self._late = [entry for entry in self._late if entry[0] > self.calls]
        return [r for _, s, _ in due for r in s], [r for _, _, loads in due for r in loads]


class HangsOnRank1(HostConnectorWorker):
    """Rank 1 never returns from wait_for_save once it has loaded something."""

    def wait_for_save(self, stream):
        if self._llm_args.rank == 1 and self.meta.loads:
            time.sleep(3600)
        super().wait_for_save(stream)


class SyncsAndFailsFinishedOnRank1(HostConnectorWorker):
    """Calls the stream it is given every pass (as a CUDA-aware worker does); rank 1's get_finished raises."""

    def start_load_kv(self, stream):
        stream.synchronize()
        super().start_load_kv(stream)

    def get_finished(self, finished_gen_req_ids, started_loading_req_ids):
        if self._llm_args.rank == 1:
            raise RuntimeError("rank 1 lost track")
        return super().get_finished(finished_gen_req_ids, started_loading_req_ids)


class PrefixLoadsRaiseOnRank1(ReservingHostWorker):
    """Rank 1's `get_finished_prefix_loads` raises once it has a load to report."""

    def get_finished_prefix_loads(self):
        done = super().get_finished_prefix_loads()
        if self._llm_args.rank == 1 and done:
            raise RuntimeError("rank 1 lost its completion queue")
        return done
