"""Probe: KVBM's real leader, driven by kvtool's engine, beside kvtool's no-op worker (its bytes
metadata goes nowhere). Shows how far the scheduler side gets without its Rust worker."""
import faulthandler
from kvtool.connector.compat import install_compat
install_compat("trtllm")
from kvbm.trtllm_integration.connector import DynamoKVBMConnectorLeader
from kvtool.connector.loader import ConnectorSpec
from kvtool.connector.request import Request
from tests.helpers.connectors import NoOpWorker
from tests.helpers.engines import make_engine

class Worker(NoOpWorker):
    def register_kv_caches(self, kv_cache_tensor):
        pass

faulthandler.dump_traceback_later(40, exit=True)
spec = ConnectorSpec("kvbm-leader", DynamoKVBMConnectorLeader, Worker, __name__)
engine = make_engine(spec, tpb=16, num_slots=32)
print("constructed; asking", flush=True)
engine.add_request(Request(1, list(range(40)), 2))
engine.step()
print("step 1 done", engine.states[1].phase, engine.connector.failures, flush=True)
engine.run()
print("run done", engine.states[1].phase, engine.connector.failures, engine.connector.violations, flush=True)
engine.add_request(Request(2, list(range(40)), 2))
engine.run()
print("second", engine.states[2].offer, engine.connector.failures, flush=True)
