"""The redis connector against a real redis-server: bit-exact hits, and every failure a miss, never
a wrong byte (each test checks the fingerprints and the tokens against a run without a connector)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from kvtool.connectors.block_codec import encode_block
from kvtool.connectors.redis_store import RedisBlockStore
from kvtool.connectors.registry import load_connector
from kvtool.engine.engine import Engine, EngineConfig
from kvtool.engine.request_state import Phase
from kvtool.engine.scheduler import SchedulerConfig
from kvtool.errors import InputError
from kvtool.manager import KvCacheManagerConfig, ReuseScope
from kvtool.manager.block_keys import chained_block_keys
from kvtool.models import load_model
from tests.helpers.servers import CuttingProxy, RedisServer, need_redis
from tests.test_connectors import SHARED, requests, tokens_of

pytestmark = pytest.mark.filterwarnings("ignore:kvtool redis connector")


def run(connector, model="tiny", options=None, reqs=None, tpb=4, setup=None, on_iteration=None):
    """One engine over `reqs` with the connector, fingerprints checked every iteration."""
    config = EngineConfig(KvCacheManagerConfig(load_model(model), tpb, num_slots=64, device="cpu"),
                          SchedulerConfig(local_reuse=False),
                          check_integrity_every_iteration=True, verify_all_after_iteration=True)
    engine = Engine(config, load_connector(connector) if connector else None, options)
    if setup:
        setup(engine)
    for r in reqs or requests():
        engine.add_request(r)
    try:
        engine.run(on_iteration=on_iteration)
    finally:
        engine.close()
    return engine


@pytest.fixture
def server():
    need_redis()
    s = RedisServer().start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference():
    return {model: tokens_of(run(None, model)) for model in ("tiny", "tiny-vswa")}


def opts(server, **more):
    """The connector's options for `server`. Its call timeout is 30 s unless a test sets its own: a
    server that answers is never counted failed (a miss) because the machine is busy."""
    return {"url": server.url, **{k: str(v) for k, v in {"timeout": 30, **more}.items()}}


def assert_served_right(engine, reference, model="tiny", offset=0):
    assert engine.integrity_errors == 0
    assert all(s.phase is Phase.DONE for s in engine.states.values())
    assert {rid - offset: t for rid, t in tokens_of(engine).items()} == reference[model]


def shared_keys(model_store: RedisBlockStore, group=0):
    return [model_store.key((key, group), 0) for _, key in chained_block_keys(SHARED, 4, ReuseScope())]


@pytest.mark.parametrize("model", ["tiny", "tiny-vswa"])
@pytest.mark.parametrize("mode", ["sync", "async", "layerwise"])
def test_cold_miss_then_warm_hit_is_bit_exact(server, reference, model, mode):
    engine = run("redis", model, opts(server, mode=mode), reqs=requests(spacing=1.0 if mode == "async" else 0.05))
    hits = [engine.states[i].num_external for i in range(4)]
    if mode == "async":
        # Saves land on the worker's thread once a request finishes, and the server is the only
        # index: a later ask sees them only if they landed first, so each hit is all or nothing.
        assert hits[0] == 0 and set(hits[1:]) <= {0, 40} and 40 in hits
    else:
        assert hits == [0, 40, 40, 40]
    assert_served_right(engine, reference, model)
    said = engine.connector.scheduler.kvtool_introspection()
    assert said.staged_bytes == 0 and said.ask_errors == 0 and said.tracked_request_ids == ()


def test_a_second_engine_is_served_what_the_first_saved(server, reference):
    run("redis", options=opts(server))
    engine = run("redis", options=opts(server), reqs=requests(offset=10))
    # Everything the first saved: the shared 10 blocks, and each request's own full tail blocks
    # (request 1's whole prompt, less the last position).
    assert [engine.states[10 + i].num_external for i in range(4)] == [40, 43, 44, 44]
    assert_served_right(engine, reference, offset=10)


def test_one_round_trip_per_ask_and_per_pass(server):
    engine = run("redis", options=opts(server))
    calls = server.client().info("commandstats")
    # Four asks: one pipelined EXISTS each; three offers: one MGET each; every block saved once
    # (request 0 computes the shared 10 blocks; each request computes its own tail blocks).
    assert calls["cmdstat_mget"]["calls"] == 3
    assert calls["cmdstat_set"]["calls"] == engine.connector.scheduler.num_saved_blocks


def test_blocks_evicted_between_the_ask_and_the_load_are_still_served(server, reference):
    """The ask fetched them: the server losing them afterwards breaks no offer."""
    run("redis", options=opts(server))
    engine_reqs = requests(offset=10)
    flushed = []

    def flush_after_ask(engine):
        scheduler = engine.connector.scheduler
        ask = scheduler.get_num_new_matched_tokens

        def asked(request, num_computed_tokens):
            answer = ask(request, num_computed_tokens)
            server.client().flushall()
            flushed.append(answer[0])
            return answer
        scheduler.get_num_new_matched_tokens = asked

    engine = run("redis", options=opts(server), reqs=engine_reqs, setup=flush_after_ask)
    assert flushed[0] == 40 and engine.states[10].num_external == 40
    assert_served_right(engine, reference, offset=10)


@pytest.mark.parametrize("damage", ["truncated", "flipped", "wrong block", "garbage"])
def test_a_damaged_value_is_a_miss_and_is_saved_again(server, reference, damage):
    first = run("redis", options=opts(server))
    store = first.connector.scheduler.store
    keys = shared_keys(store)
    client = server.client()
    victim = client.get(keys[3])
    damaged = {"truncated": victim[:-5], "flipped": victim[:-1] + bytes([victim[-1] ^ 1]),
               "wrong block": client.get(keys[4]), "garbage": b"not a block"}[damage]
    client.set(keys[3], damaged)
    engine = run("redis", options=opts(server), reqs=requests(offset=10))
    assert engine.states[10].num_external == 12          # blocks 0-2 served; block 3 a miss
    assert engine.connector.scheduler.store.num_corrupt >= 1
    assert_served_right(engine, reference, offset=10)
    assert client.get(keys[3]) == victim                 # the recompute saved it again, whole


def test_no_server_is_all_misses(reference):
    need_redis()
    dead = RedisServer()                                  # never started: connection refused
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = run("redis", options={"url": dead.url, "timeout": "0.5"})
    assert [engine.states[i].num_external for i in range(4)] == [0, 0, 0, 0]
    assert_served_right(engine, reference)
    assert engine.connector.scheduler.store.num_errors > 0
    assert any("ConnectionError" in str(w.message) for w in caught)


def test_a_server_killed_and_restarted_empty_mid_run(server, reference):
    reqs = requests(spacing=1.0)

    def crash_and_restart(engine):
        if engine.iteration == 3:
            server.kill()
        if engine.iteration == 6:
            server.start()                                 # same port, nothing in it

    engine = run("redis", options=opts(server, timeout=0.5, retry_after=0), reqs=reqs, on_iteration=crash_and_restart)
    assert_served_right(engine, reference)
    assert engine.connector.scheduler.store.num_errors > 0
    assert server.client().dbsize() > 0                    # saves resumed after the restart


def test_connections_dropped_mid_run_reconnect(server, reference):
    """Every connection of the connector is killed at every iteration: the client opens new ones and
    every request is served as in an undisturbed run (same hits, no failed call)."""
    undisturbed = run("redis", options=opts(server), reqs=requests(spacing=1.0))
    server.client().flushall()
    admin = server.client()
    opened_before = admin.info("stats")["total_connections_received"]
    kills: list[int] = []

    def drop_connections(engine):
        kills.append(admin.client_kill_filter(_type="normal", skipme=True))

    engine = run("redis", options=opts(server), reqs=requests(spacing=1.0), on_iteration=drop_connections)
    reopened = admin.info("stats")["total_connections_received"] - opened_before
    assert sum(kills) >= 2 and reopened >= 2, (kills, reopened)
    hits = [engine.states[i].num_external for i in range(4)]
    assert hits == [undisturbed.states[i].num_external for i in range(4)] and hits[0] == 0 and min(hits[1:]) > 0
    assert engine.connector.scheduler.store.num_errors == 0
    assert_served_right(engine, reference)


def test_a_connection_cut_in_the_middle_of_a_reply_is_a_miss(server, reference):
    """The MGET of the first offer breaks off part-way through the values: that offer is not made,
    the client reconnects, and the later requests are served."""
    run("redis", options=opts(server))
    proxy = CuttingProxy(server.port, cut_after=10_000)     # inside the first MGET: 10 values of 2 KiB
    try:
        def arm(engine):
            proxy.armed = True
        engine = run("redis", options=opts(proxy, retry_after=0), reqs=requests(offset=10, spacing=1.0), setup=arm)
    finally:
        proxy.close()
    assert proxy.num_cuts == 1 and engine.connector.scheduler.store.num_errors == 1
    hits = [engine.states[10 + i].num_external for i in range(4)]
    assert hits[0] == 0 and hits[1:] == [43, 44, 44]
    assert_served_right(engine, reference, offset=10)


def test_a_paused_server_times_out_into_misses(server, reference):
    run("redis", options=opts(server))
    # paused for longer than the run takes however busy the machine (the fixture's server ends with the test)
    server.client().execute_command("CLIENT", "PAUSE", "600000", "ALL")
    engine = run("redis", options=opts(server, timeout=0.2), reqs=requests(offset=10))
    assert [engine.states[10 + i].num_external for i in range(4)] == [0, 0, 0, 0]
    assert engine.connector.scheduler.store.num_errors > 0
    assert_served_right(engine, reference, offset=10)


def test_out_of_memory_under_noeviction_drops_saves_not_requests(reference):
    need_redis()
    server = RedisServer("--maxmemory-policy", "noeviction").start()
    try:
        filler = server.client()
        filler.set("ballast", b"x" * 2_000_000)
        filler.config_set("maxmemory", "1mb")                    # past maxmemory: every SET fails now
        engine = run("redis", options=opts(server))
        assert_served_right(engine, reference)
        assert engine.connector.workers[0].store.num_errors > 0     # the saves, refused
        assert [engine.states[i].num_external for i in range(4)] == [0, 0, 0, 0]
    finally:
        server.stop()


def test_other_layouts_never_read_a_block(server):
    run("redis", options=opts(server))
    other_block_size = run("redis", options=opts(server), reqs=requests(offset=10), tpb=8)
    other_model = run("redis", "tiny-vswa", opts(server), reqs=requests(offset=20))
    assert other_block_size.states[10].num_external == 0 and other_model.states[20].num_external == 0
    signatures = {key.rsplit(b":", 3)[0] for key in server.client().keys("*")}
    assert len(signatures) == 3                              # one per layout


def test_a_url_holding_a_password_is_refused():
    from kvtool.connector.options import check_options
    from kvtool.connectors.redis_connector import RedisConnectorScheduler
    with pytest.raises(InputError, match="password_env"):
        check_options("redis", RedisConnectorScheduler.kvtool_options, {"url": "redis://:pw@127.0.0.1:6379/0"})


def test_ttl_and_prefix(server):
    run("redis", options=opts(server, ttl=100, prefix="team-a"))
    client = server.client()
    keys = client.keys("*")
    assert keys and all(key.startswith(b"team-a:") for key in keys)
    assert all(0 < client.pttl(key) <= 100_000 for key in keys)


def test_the_password_comes_from_the_environment(reference, monkeypatch, tmp_path):
    need_redis()
    server = RedisServer("--requirepass", "s3cret-pw").start()
    try:
        monkeypatch.setenv("KVTOOL_TEST_REDIS_PW", "s3cret-pw")
        run("redis", options=opts(server, password_env="KVTOOL_TEST_REDIS_PW"))
        engine = run("redis", options=opts(server, password_env="KVTOOL_TEST_REDIS_PW"), reqs=requests(offset=10))
        assert engine.states[10].num_external == 40
        assert_served_right(engine, reference, offset=10)
        workload = Path(__file__).resolve().parents[1] / "workloads" / "shared_prefix.jsonl"
        done = kvtool("trace", "run", str(workload), "--connector", "redis", "--connector-opt", f"url={server.url}",
                      "--connector-opt", "password_env=KVTOOL_TEST_REDIS_PW", "--output", str(tmp_path / "run"))
        assert done.returncode == 0, done.stderr[-2000:]
        written = "".join(p.read_text() for p in (tmp_path / "run").iterdir() if p.suffix in (".json", ".csv"))
        assert "s3cret-pw" not in written + done.stdout + done.stderr and "KVTOOL_TEST_REDIS_PW" in written
        monkeypatch.delenv("KVTOOL_TEST_REDIS_PW")
        with pytest.raises(InputError, match="KVTOOL_TEST_REDIS_PW, which is not set"):
            run("redis", options=opts(server, password_env="KVTOOL_TEST_REDIS_PW"))
    finally:
        server.stop()


def test_a_value_encodes_its_block():
    value = encode_block(b"\x01" * 32, 2, b"page")
    assert value.endswith(b"page") and len(value) == 8 + 4 + 32 + 8 + 32 + 4


# ---- the CLI: validate, and two processes sharing one server -----------------------------------------
def kvtool(*args, env=None, cwd=None):
    import os
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "kvtool", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, **(env or {})}, timeout=600)


def test_validate_redis_passes_every_scenario_with_the_remote_ones(server):
    done = kvtool("validate", "redis", "--model", "tiny-vswa", "--connector-opt", f"url={server.url}",
                  "--remote", server.url, "--format", "json")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    import json
    checks = json.loads(done.stdout)["results"]
    remote = {(c["scenario"], c["check"]): c["verdict"] for c in checks if c["scenario"].startswith("remote-")}
    assert len(remote) == 6 and set(remote.values()) == {"pass"}


def test_the_remote_scenarios_catch_a_connector_that_fetches_at_the_load(server):
    done = kvtool("validate", "tests.helpers.broken_remote_connectors:FetchAtLoad:FetchAtLoadWorker",
                  "--model", "tiny", "--connector-opt", f"url={server.url}", "--remote", server.url,
                  "--scenario", "remote-lost-after-ask", "--scenario", "cold-warm", "--format", "json")
    assert done.returncode == 1, done.stderr[-2000:]
    import json
    verdicts = {(c["scenario"], c["check"]): c["verdict"] for c in json.loads(done.stdout)["results"]}
    assert verdicts[("remote-lost-after-ask", "integrity")] == "fail"
    assert verdicts[("cold-warm", "integrity")] == "pass"      # undisturbed, it looks right


def test_two_processes_share_prefixes_through_the_server(server, tmp_path):
    from pathlib import Path
    workload = Path(__file__).resolve().parents[1] / "workloads" / "shared_prefix.jsonl"
    runs = []
    for i in (1, 2):
        done = kvtool("trace", "run", str(workload), "--connector", "redis", "--connector-opt", f"url={server.url}",
                      "--no-local-reuse", "--output", str(tmp_path / f"run{i}"))
        assert done.returncode == 0, done.stderr[-2000:]
        import json
        runs.append(json.loads((tmp_path / f"run{i}" / "summary.json").read_text()))
    first, second = runs
    assert first["integrity_errors"] == second["integrity_errors"] == 0
    assert second["failed_requests"] == 0
    # The second process computes only what no prompt of the workload shares with another
    # (and the last position): everything else comes from what the first one saved.
    assert second["connector_hit_tokens"] > first["connector_hit_tokens"]
    assert second["computed_tokens"] < first["computed_tokens"] / 5


def test_tensor_parallel_ranks_each_save_and_are_served_their_own_shard(server, tmp_path):
    """Two ranks as processes, each saving its half of the heads under its rank; the second run's
    scheduler fetches both halves at the ask and each rank loads its own."""
    workload = Path(__file__).resolve().parents[1] / "workloads" / "shared_prefix.jsonl"
    summaries = []
    for i in (1, 2):
        done = kvtool("trace", "run", str(workload), "--connector", "redis", "--connector-opt", f"url={server.url}",
                      "--num-ranks", "2", "--tp", "2", "--no-local-reuse", "--output", str(tmp_path / f"run{i}"))
        assert done.returncode == 0, done.stderr[-2000:]
        import json
        summaries.append(json.loads((tmp_path / f"run{i}" / "summary.json").read_text()))
    assert all(s["integrity_errors"] == 0 and s["failed_requests"] == 0 for s in summaries)
    assert summaries[1]["computed_tokens"] < summaries[0]["computed_tokens"] / 5
    ranks = {key.split(b":")[2] for key in server.client().keys("*")}
    assert ranks == {b"r0", b"r1"}


def test_the_index_tier_saves_in_every_mode(server):
    """Block fidelity's redis-index writes its headers whether saves come per pass or per layer."""
    from kvtool.connectors.registry import load_connector as load
    from kvtool.engine.engine import Engine, EngineConfig
    for mode in ("sync", "layerwise"):
        config = EngineConfig(KvCacheManagerConfig(load_model("tiny"), 4, num_slots=64, device="cpu"),
                              SchedulerConfig(local_reuse=False), fidelity="blocks")
        engine = Engine(config, load("redis-index"), opts(server, mode=mode, prefix=f"idx-{mode}"))
        for r in requests():
            engine.add_request(r)
        engine.run()
        engine.close()
        assert [engine.states[i].num_external for i in range(4)] == [0, 40, 40, 40], mode
        assert server.client().keys(f"idx-{mode}:*")


def test_an_offer_is_shortened_to_the_staging_room(server, reference):
    """Four tiny blocks (2 KiB each) of staging: each offer stages at most four of the ten shared blocks."""
    run("redis", options=opts(server))
    engine = run("redis", options=opts(server, staging="8KiB"), reqs=requests(offset=10, spacing=1.0))
    assert [engine.states[10 + i].num_external for i in range(4)] == [16, 16, 16, 16]
    assert engine.connector.scheduler.num_staged_bytes == 0
    assert_served_right(engine, reference, offset=10)
