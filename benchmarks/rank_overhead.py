"""What ranks as processes cost: µs per iteration spent in the per-iteration collectives (the
order broadcast and the report gather) at N = 1 (a group of one), 2 and 4, against the same replay
without a process group in the same run; and the shipped workload's wall time at N = 1 and 2.

    python -m benchmarks.rank_overhead > rank_overhead.json

Every replay uses the host connector, tensor-parallel shards where the model allows, CPU pools.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from kvtool.connectors.registry import load_connector
from kvtool.engine.engine import Engine, EngineConfig
from kvtool.engine.pass_driver import PassPlan
from kvtool.engine.ranks import Followers, PassOrder, RankSetup
from kvtool.engine.scheduler import SchedulerConfig
from kvtool.manager import KvCacheManagerConfig
from kvtool.models import load_model
from kvtool.workloads.source import load_workload

WORKLOAD = Path(__file__).resolve().parents[1] / "workloads" / "shared_prefix.jsonl"


def replay(num_ranks: int, processes: bool, tokens_per_block: int = 32) -> dict:
    model = load_model("tiny")
    tp = num_ranks if processes and num_ranks in (1, 2) else 1
    config = EngineConfig(KvCacheManagerConfig(model, tokens_per_block, num_slots=512, device="cpu"),
                          SchedulerConfig(local_reuse=False), num_ranks=num_ranks, tp_size=tp,
                          ranks_as_processes=processes, process_group_of_one=processes and num_ranks == 1)
    started = time.perf_counter()
    engine = Engine(config, load_connector("host"))
    setup = time.perf_counter() - started
    try:
        for request in load_workload(WORKLOAD):
            engine.add_request(request)
        started = time.perf_counter()
        engine.run()
        seconds = time.perf_counter() - started
    finally:
        engine.close()
    return {"num_ranks": num_ranks, "processes": processes, "tp": tp, "setup_seconds": round(setup, 3),
            "replay_seconds": round(seconds, 3), "iterations": engine.iteration,
            "integrity_errors": engine.integrity_errors,
            "us_per_iteration": round(seconds / engine.iteration * 1e6, 1)}


def empty_round_trip_us(num_ranks: int, repeats: int = 200) -> float:
    """µs for one iteration's collectives with nothing in the order: the floor of the cost."""
    config = KvCacheManagerConfig(load_model("tiny"), 32, num_slots=64, device="cpu")
    followers = Followers(RankSetup(config, (64,), 1, num_ranks, 0, None, (), 0, 60.0, "cpu"))
    order = PassOrder(0, None, [], [], [], PassPlan(starts=True, forwards=True))
    try:
        for _ in range(5):
            followers.broadcast(order)
            followers.gather()
        started = time.perf_counter()
        for _ in range(repeats):
            followers.broadcast(order)
            followers.gather()
        return round((time.perf_counter() - started) / repeats * 1e6, 1)
    finally:
        followers.close()


def main() -> None:
    baseline = replay(1, processes=False)
    rows = [baseline] + [replay(n, processes=True) for n in (1, 2, 4)]
    for row in rows:
        row["extra_us_per_iteration"] = round(row["us_per_iteration"] - baseline["us_per_iteration"], 1)
        if row["processes"]:
            row["empty_round_trip_us"] = empty_round_trip_us(row["num_ranks"])
    print(json.dumps({"workload": WORKLOAD.name, "cpu_cores": os.cpu_count(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
