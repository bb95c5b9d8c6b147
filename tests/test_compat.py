"""--compat trtllm: the names connectors in the field import (TensorRT-LLM's examples, NVIDIA Dynamo's
KVBM 1.6.1, LMCache 0.5.6) resolve to kvtool's classes with TensorRT-LLM's meaning, and
`mpi_rank()` answers the rank whose hook runs."""

from __future__ import annotations

import subprocess
import sys

from kvtool.connector import rank_context
from kvtool.connector.loader import ConnectorSpec
from kvtool.connector.request import Request
from kvtool.connectors.host import HostConnectorScheduler, HostConnectorWorker
from tests.helpers.engines import make_engine

IMPORTS = """
from kvtool.connector.compat import install_compat
install_compat("trtllm")
import tensorrt_llm
from tensorrt_llm import LLM, SamplingParams, logger, mpi_rank
from tensorrt_llm._utils import mpi_rank as utils_mpi_rank, mpi_world_size
from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import (
    KvCacheConnectorScheduler, KvCacheConnectorWorker, SchedulerOutput, RequestData)
from tensorrt_llm._torch.pyexecutor.kv_cache_connector import KvCacheConnectorScheduler as Old
from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_layout import (
    KvCacheRegion, KvCacheLayout, KvCacheLayerGroupLayout, valid_page_slots, BAD_PAGE_INDEX as LAYOUT_BAD)
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, LlmRequestState, get_draft_token_length
from tensorrt_llm.runtime.kv_cache_manager_v2 import BAD_PAGE_INDEX
from tensorrt_llm.bindings.internal.batch_manager import LlmRequest as BoundRequest
from tensorrt_llm.llmapi.llm_args import KvCacheConfig, KvCacheConnectorConfig, TorchLlmArgs
from tensorrt_llm.mapping import Mapping
import kvtool.connector as k
assert KvCacheConnectorScheduler is Old is k.KvCacheConnectorScheduler and RequestData is k.RequestData
assert BAD_PAGE_INDEX == LAYOUT_BAD == -1 and mpi_rank is utils_mpi_rank and mpi_rank() == 0
assert LlmRequest is BoundRequest is k.Request and tensorrt_llm.__version__ == "kvtool-compat"
assert get_draft_token_length(k.Request(1, [1, 2], 1)) == 0 and KvCacheConnectorConfig().server_url is None
assert RequestData(1, [], [], 0, 1).priorities is None and SchedulerOutput().prefix_loads == []
try:
    LLM(model="x")
except RuntimeError as exc:
    assert "starts a TensorRT-LLM engine" in str(exc)
print("ok")
"""


def test_the_names_field_connectors_import_resolve():
    done = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


class _RankRecorder(HostConnectorWorker):
    seen: list[tuple[int, int, int]] = []

    def start_load_kv(self, stream):
        mapping = self._llm_args.parallel_config.to_mapping()
        _RankRecorder.seen.append((rank_context.current_rank(), mapping.rank, mapping.world_size))
        super().start_load_kv(stream)


def test_every_hook_runs_as_its_rank_and_the_mapping_agrees():
    spec = ConnectorSpec("recorder", HostConnectorScheduler, _RankRecorder, __name__)
    engine = make_engine(spec, num_ranks=2)
    engine.add_request(Request(1, list(range(9)), 2))
    engine.run()
    assert sorted(set(_RankRecorder.seen)) == [(0, 0, 2), (1, 1, 2)]
    assert rank_context.current_rank() == 0
    args = engine.llm_args(spec, {}, 1)
    assert (args.tensor_parallel_size, args.enable_attention_dp,
            args.parallel_config.to_mapping().tp_rank) == (1, False, 0)
