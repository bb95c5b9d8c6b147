"""The NCCL path with one GPU: a process group of one (rank 0 alone) runs every collective of a
multi-rank run on device pools. Skipped without a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtool.connectors.registry import load_connector
from kvtool.engine.engine import EngineConfig
from kvtool.engine.scheduler import SchedulerConfig
from kvtool.manager import KvCacheManagerConfig
from kvtool.models import load_model
from kvtool.trace.replay import run_trace
from kvtool.workloads.source import load_workload

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

WORKLOAD = Path(__file__).resolve().parents[2] / "workloads" / "shared_prefix.jsonl"


def replay(device: str, group: bool):
    config = EngineConfig(KvCacheManagerConfig(load_model("tiny"), 32, num_slots=512, device=device),
                          SchedulerConfig(local_reuse=False), ranks_as_processes=group, process_group_of_one=group)
    return run_trace(load_workload(WORKLOAD), config, load_connector("host"), {}).summary.as_dict()


@pytest.mark.parametrize("connector", ["host"])
def test_a_group_of_one_over_nccl_serves_what_one_rank_on_the_cpu_serves(connector):
    on_gpu, on_cpu = replay("cuda", True), replay("cpu", False)
    assert on_gpu["integrity_errors"] == 0 and on_gpu["failed_requests"] == 0
    keys = ("connector_hit_tokens", "computed_tokens", "loaded_blocks", "saved_blocks")
    assert {k: on_gpu[k] for k in keys} == {k: on_cpu[k] for k in keys}
    assert not torch.distributed.is_initialized()   # the group was left at the end
