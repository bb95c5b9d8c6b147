"""KVBM 1.6.1's TensorRT-LLM leader and worker built by kvtool's engine on DEVICE pages (argv[1],
default cuda), 32 tokens a block: how long construction and registration take, and, should either
hang, where (every thread's stack after HANG_S seconds, then exit 1). Run by field-kits/field-gpu.sh before
the validate batches, whose preflight would hang the same way with no stack to show."""
import faulthandler
import sys
import time

HANG_S = 45


def main(device):
    faulthandler.dump_traceback_later(HANG_S, exit=True, file=sys.stdout)
    from kvtool.connector.compat import install_compat
    install_compat("trtllm")
    t0 = time.perf_counter()
    from kvbm.trtllm_integration.connector import DynamoKVBMConnectorLeader, DynamoKVBMConnectorWorker

    from kvtool.connector.loader import ConnectorSpec
    from kvtool.engine.engine import Engine, EngineConfig
    from kvtool.manager import KvCacheManagerConfig
    from kvtool.models import load_model
    print(f"imported in {time.perf_counter() - t0:.2f} s", flush=True)
    spec = ConnectorSpec("kvbm", DynamoKVBMConnectorLeader, DynamoKVBMConnectorWorker, __name__)
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(KvCacheManagerConfig(load_model("tiny"), 32, num_slots=64, device=device)), spec)
    print(f"leader and worker constructed, KV cache registered on {device} in {time.perf_counter() - t0:.2f} s",
          flush=True)
    del engine
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cuda")
