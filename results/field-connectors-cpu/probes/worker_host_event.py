"""Diagnostic only (not a result): KVBM's worker with torch.cuda.Event replaced by an object that
records nothing, to see what stops it after the CUDA event on a CPU-only torch."""
import faulthandler, torch
class _HostEvent:
    cuda_event = 0
    def __init__(self, *a, **k): pass
    def record(self, *a, **k): pass
torch.cuda.Event = _HostEvent
torch.cuda.current_stream = lambda *a, **k: None
faulthandler.dump_traceback_later(60, exit=True)
from kvtool.connector.compat import install_compat
install_compat("trtllm")
from kvbm.trtllm_integration.connector import DynamoKVBMConnectorLeader, DynamoKVBMConnectorWorker
from kvtool.connector.loader import ConnectorSpec
from tests.helpers.engines import make_engine
def _register_as_device_0(self, kv_cache_tensor):
    """The wheel's register_kv_caches with device 0 for the CPU tensor's None index."""
    self.events = [_HostEvent() for _ in range(kv_cache_tensor.shape[1])]
    self._connector.register_kv_caches(kv_cache_tensor.shape[0], self._llm_args.kv_cache_config.tokens_per_block,
                                       0, kv_cache_tensor.dtype.itemsize, kv_cache_tensor, [0] * len(self.events))
import sys as _s
if "--device0" in _s.argv:
    DynamoKVBMConnectorWorker.register_kv_caches = _register_as_device_0
spec = ConnectorSpec("kvbm", DynamoKVBMConnectorLeader, DynamoKVBMConnectorWorker, __name__)
engine = make_engine(spec, tpb=16, num_slots=32)
print("constructed and registered", flush=True)
