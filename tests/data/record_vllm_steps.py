"""Record the steps vLLM 0.32.0's scheduler takes for kvtool-host on the `tiny` model, two requests
that outgrow the cache (one is preempted and resumed with a new block list), then a follow-up of the
preempted one's sequence: tests/data/vllm_steps.json, replayed without vLLM by
tests/test_vllm_recorded_steps.py. Run with vLLM installed: python tests/data/record_vllm_steps.py"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

FILE = Path(__file__).with_name("vllm_steps.json")
BLOCK_SIZE = 4


def prompt(which: int, length: int) -> list[int]:
    return [(which * 104_729 + i * 31) % 30_000 + 3 for i in range(length)]


def record() -> dict[str, Any]:
    """The recorded steps (what FILE holds)."""
    from kvtool.models import load_model
    from kvtool.vllm_compat.driver import VllmRun
    from kvtool.vllm_compat.engine_setup import EngineShape, build_engine
    from kvtool.vllm_compat.model_config import VllmModel
    from kvtool.vllm_compat.recorded_steps import record_output
    from kvtool.vllm_compat.target import parse_target

    with tempfile.TemporaryDirectory() as folder:
        target = parse_target("kvtool-host", {"store": folder})
        shape = EngineShape(block_size=BLOCK_SIZE, blocks_per_group=20, max_model_len=20 * BLOCK_SIZE,
                            prefix_caching=False)
        run = VllmRun(build_engine(VllmModel.of(load_model("tiny")), shape, target, Path(folder) / "engine"))
        steps: list[dict[str, Any]] = []
        run.observers.append(lambda output, scheduled: steps.append(record_output(output, scheduled)))
        run.add("r1", prompt(1, 6 * BLOCK_SIZE), max_tokens=9 * BLOCK_SIZE)
        run.add("r2", prompt(2, 6 * BLOCK_SIZE), max_tokens=9 * BLOCK_SIZE)
        run.run()
        run.scheduler.reset_prefix_cache()
        preempted = sorted(rid for rid, o in run.outcomes.items() if o.num_preemptions)
        run.add("follow-up", run.tokens(preempted[0])[:14 * BLOCK_SIZE], max_tokens=3)
        run.run()
        return {"vllm": "0.32.0", "model": "tiny", "block_size": BLOCK_SIZE, "connector": "kvtool-host",
                "preempted": preempted, "wrong_reads": run.integrity.num_wrong, "steps": steps}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parents[2]))
    FILE.write_text(json.dumps(record(), separators=(",", ":")) + "\n")
    print(f"wrote {FILE}")
