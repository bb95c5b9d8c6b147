"""`trace run --instances`: routing, the lockstep of clocks, and N processes sharing one store."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
from helpers.traces import random_mooncake_trace

from kvtool.connector.request import Request
from kvtool.trace.instances import (
    LATENCIES,
    ROUTE_BLOCK_TOKENS,
    Route,
    _lockstep,
    assign_requests,
    fleet_rows,
    latency_columns,
    with_load_ratios,
)
from tests.helpers.servers import RedisServer, need_redis

WORKLOAD = Path(__file__).resolve().parents[1] / "workloads" / "shared_prefix.jsonl"
B = ROUTE_BLOCK_TOKENS


def prompt(seed: int, blocks: float) -> list[int]:
    return [seed * 100_000 + i for i in range(int(blocks * B))]


def test_round_robin_deals_requests_in_turn():
    reqs = [Request(i, [i + 1] * 10, 1) for i in range(7)]
    assert list(assign_requests(reqs, 3, Route.ROUND_ROBIN)) == [0, 1, 2, 0, 1, 2, 0]


def test_prefix_routing_follows_the_longest_prefix_it_sent_and_balances_the_rest():
    a, b = prompt(1, 4), prompt(2, 2)
    reqs = [Request(0, a, 1),                       # nothing known: the least loaded, 0
            Request(1, b, 1),                       # nothing shared: the least loaded, 1
            Request(2, a + prompt(3, 2), 1),        # 4 of 6 blocks where request 0 went: 0
            Request(3, b[:B] + prompt(4, 3), 1),    # 1 block of 4 shared: not enough; least loaded is 1
            Request(4, a[:B] + prompt(5, 1), 1)]    # 1 block of 2 shared, half: follows it to 0
    assert list(assign_requests(reqs, 2, Route.PREFIX)) == [0, 1, 0, 1, 0]


def test_an_instance_waits_while_another_lags_past_the_window():
    clocks, done = [0.0, 2.0], [0, 0]
    hook = _lockstep(0, clocks, done, window_s=1.0)
    engine = type("E", (), {"clock": 5.0})()
    waiter = threading.Thread(target=hook, args=(engine,))
    waiter.start()
    time.sleep(0.05)
    assert waiter.is_alive()                      # instance 1 is 3 s behind
    clocks[1] = 4.5
    waiter.join(timeout=120)                      # a hang guard: it is woken at once
    assert not waiter.is_alive() and clocks[0] == 5.0
    clocks[1] = 0.0
    done[1] = 1                                   # a finished instance holds nobody back
    hook(engine)


def kvtool(*args):
    return subprocess.run([sys.executable, "-m", "kvtool", *args], capture_output=True, text=True, timeout=600)


def replay(tmp_path, name, *args):
    done = kvtool("trace", "run", str(WORKLOAD), "--no-local-reuse", "--output", str(tmp_path / name), *args)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads((tmp_path / name / "instances.json").read_text())


def test_instances_sharing_redis_hit_each_others_prefixes(tmp_path):
    need_redis()
    server = RedisServer().start()
    try:
        shared = replay(tmp_path, "shared", "--instances", "2", "--connector", "redis", "--connector-opt",
                        f"url={server.url}")
    finally:
        server.stop()
    local = replay(tmp_path, "local", "--instances", "2", "--connector", "host")
    for document in (shared, local):
        rows, total = document["instances"], document["all"]
        assert [r["num_requests"] for r in rows] == [12, 12] and total["num_requests"] == 24
        assert total["integrity_errors"] == 0 and total["failed_requests"] == 0
        assert total["prompt_tokens"] == 7408 == sum(r["prompt_tokens"] for r in rows)
    # One cache for both: each prefix is computed once in all, not once per instance.
    assert shared["all"]["connector_hit_tokens"] > local["all"]["connector_hit_tokens"]
    assert shared["all"]["hit_rate"] > local["all"]["hit_rate"]


def test_bad_instance_options_are_usage_errors():
    for args, message in ((["--instances", "0"], "--instances must be positive"),
                          (["--instances", "2", "--baseline", "--connector", "host"], "replay one instance"),
                          (["--instances", "2", "--sync-window", "0"], "--sync-window must be")):
        done = kvtool("trace", "run", str(WORKLOAD), *args)
        assert done.returncode == 2 and message in done.stderr, done.stderr


def test_an_instance_that_dies_is_reported_not_waited_for():
    done = kvtool("trace", "run", str(WORKLOAD), "--instances", "2", "--connector",
                  "tests.helpers.dying_connector:DiesAtAsk:HostConnectorWorker")
    assert done.returncode == 2 and "exited with code 7 without a report" in done.stderr, done.stderr[-2000:]


def test_the_fleet_row_has_percentiles_over_every_request_and_the_busiest_load():
    rows = with_load_ratios([
        {"instance": 0, "prompt_tokens": 300, "local_hit_tokens": 0, "connector_hit_tokens": 0,
         LATENCIES: ([1.0, 2.0, 3.0], [0.1])},
        {"instance": 1, "prompt_tokens": 200, "local_hit_tokens": 50, "connector_hit_tokens": 50,
         LATENCIES: ([4.0], [])}])
    for row in rows:
        row.update(num_requests=1, computed_tokens=0, cancelled_tokens=0, integrity_errors=0, failed_requests=0,
                   iterations=1, evictions=0, wall_seconds=1.0, failed_checks="")
    assert [r["load_ratio"] for r in rows] == [1.5, 0.5]      # 300 and 100 computed, mean 200
    written, total = fleet_rows(rows)
    assert LATENCIES not in written[0] and total["load_imbalance"] == 1.5
    assert (total["ttft_p50_s"], total["ttft_p99_s"], total["tpot_p50_s"]) == (2.5, pytest.approx(3.97), 0.1)
    assert latency_columns([]) == {f"{m}_p{p}_s": None for m, ps in (("ttft", (50, 90, 99)), ("tpot", (50, 99)))
                                   for p in ps}


def test_instances_report_ttft_and_load_per_engine_and_for_the_fleet(tmp_path):
    trace = tmp_path / "m.jsonl"
    random_mooncake_trace(trace, 24, 64, seed=5)
    done = kvtool("trace", "run", str(trace), "--source-block-size", "64", "--prefill-only", "--instances", "2",
                  "--connector", "index", "--output", str(tmp_path / "fleet"))
    assert done.returncode == 0, done.stderr[-2000:]
    frame = pd.read_csv(tmp_path / "fleet" / "instances.csv")
    engines, fleet = frame.iloc[:2], frame.iloc[2]
    assert engines["load_ratio"].mean() == pytest.approx(1.0) and fleet["load_imbalance"] == engines["load_ratio"].max()
    assert (engines["ttft_p50_s"] > 0).all() and min(engines["ttft_p50_s"]) <= fleet["ttft_p50_s"] <= \
        max(engines["ttft_p99_s"]) and fleet["ttft_p99_s"] == pytest.approx(max(engines["ttft_p99_s"]), rel=0.2)
    assert "TTFT p50" in done.stdout and "load" in done.stdout
