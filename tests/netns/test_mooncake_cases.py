"""The mooncake connector against a real Mooncake Store (master + a mooncake_client pool). These run
only inside a private network namespace, where tests/test_mooncake_connector.py starts them: the
master's listeners bind every interface whatever address it is given."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtool.connectors.remote_store import StagedEntry
from kvtool.manager import ReuseScope
from kvtool.manager.block_keys import chained_block_keys
from tests.helpers.servers import MooncakeStore
from tests.test_connectors import SHARED, requests, tokens_of
from tests.test_redis_connector import assert_served_right, run

pytestmark = [pytest.mark.skipif(os.environ.get("KVTOOL_PRIVATE_NET") != "1",
                                 reason="runs inside a private network namespace (test_mooncake_connector.py)"),
              pytest.mark.filterwarnings("ignore:kvtool mooncake connector")]
WORKLOAD = Path(__file__).resolve().parents[2] / "workloads" / "shared_prefix.jsonl"


@pytest.fixture(scope="module")
def store():
    s = MooncakeStore().start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference():
    return {model: tokens_of(run(None, model)) for model in ("tiny", "tiny-vswa")}


_runs = iter(range(1_000_000))


def opts(store, **more):
    """The store's address and a prefix of this test's own (one pool serves the module)."""
    return {**store.options, "prefix": f"t{os.getpid()}-{next(_runs)}", **{k: str(v) for k, v in more.items()}}


@pytest.mark.parametrize("model", ["tiny", "tiny-vswa"])
@pytest.mark.parametrize("mode", ["sync", "layerwise"])
def test_cold_miss_then_warm_hit_is_bit_exact(store, reference, model, mode):
    engine = run("mooncake", model, opts(store, mode=mode))
    assert [engine.states[i].num_external for i in range(4)] == [0, 40, 40, 40]
    assert_served_right(engine, reference, model)
    assert engine.connector.scheduler.kvtool_introspection().staged_bytes == 0


def test_a_second_engine_is_served_what_the_first_saved(store, reference):
    options = opts(store)
    run("mooncake", options=options)
    engine = run("mooncake", options=options, reqs=requests(offset=10))
    assert [engine.states[10 + i].num_external for i in range(4)] == [40, 43, 44, 44]
    assert_served_right(engine, reference, offset=10)


def shared_keys(engine):
    s = engine.connector.scheduler.store
    return [s.key((key, 0), 0) for _, key in chained_block_keys(SHARED, 4, ReuseScope())]


def test_blocks_removed_between_the_ask_and_the_load_are_still_served(store, reference):
    options = opts(store)
    first = run("mooncake", options=options)
    raw = store.client()
    keys = shared_keys(first)

    def remove_after_ask(engine):
        scheduler = engine.connector.scheduler
        ask = scheduler.get_num_new_matched_tokens

        def asked(request, num_computed_tokens):
            answer = ask(request, num_computed_tokens)
            for key in keys:
                raw.remove(key, True)        # forced: a key just read is leased
            return answer
        scheduler.get_num_new_matched_tokens = asked

    engine = run("mooncake", options=options, reqs=requests(offset=10), setup=remove_after_ask)
    assert engine.states[10].num_external == 40          # served, though removed right after its offer
    assert_served_right(engine, reference, offset=10)
    raw.close()


def test_a_damaged_value_is_a_miss_and_is_saved_again(store, reference):
    options = opts(store)
    first = run("mooncake", options=options)
    keys = shared_keys(first)
    raw = store.client()
    whole = raw.get(keys[3])
    assert raw.remove(keys[3], True) == 0 and raw.put(keys[3], whole[:-9] + b"x" * 9) == 0
    engine = run("mooncake", options=options, reqs=requests(offset=10))
    assert engine.states[10].num_external == 12          # blocks 0-2 served; block 3 a miss
    assert engine.connector.scheduler.store.num_corrupt >= 1
    assert_served_right(engine, reference, offset=10)
    raw.close()


def test_other_layouts_never_read_a_block(store):
    options = opts(store)
    run("mooncake", options=options)
    other_block_size = run("mooncake", options=options, reqs=requests(offset=10), tpb=8)
    other_model = run("mooncake", "tiny-vswa", options, reqs=requests(offset=20))
    assert other_block_size.states[10].num_external == 0 and other_model.states[20].num_external == 0


def test_no_master_is_all_misses_quickly(reference, monkeypatch):
    """The probe answers, not a client's minutes-long setup against the dead master: none is made."""
    import mooncake.store
    made = []
    monkeypatch.setattr(mooncake.store, "MooncakeDistributedStore", lambda: made.append(1) or 1 / 0)
    dead = MooncakeStore()                                # never started
    engine = run("mooncake", options={**dead.options, "retry_after": "60"})
    assert made == []
    assert [engine.states[i].num_external for i in range(4)] == [0, 0, 0, 0]
    assert_served_right(engine, reference)
    assert engine.connector.scheduler.store.num_errors >= 1


def test_a_master_killed_mid_run(reference):
    own = MooncakeStore().start()
    try:
        def kill_master(engine):
            if engine.iteration == 3:
                own.kill_master()
        engine = run("mooncake", options={**own.options, "retry_after": "60"}, reqs=requests(spacing=1.0),
                     on_iteration=kill_master)
        assert_served_right(engine, reference)
    finally:
        own.stop()


def test_a_staged_entry_holds_every_rank():
    assert StagedEntry((b"ab", b"cde")).nbytes == 5


def kvtool(*args):
    return subprocess.run([sys.executable, "-m", "kvtool", *args], capture_output=True, text=True, timeout=600)


def test_two_processes_share_prefixes_through_the_store(store, tmp_path):
    pairs = [f"{k}={v}" for k, v in opts(store).items()]
    summaries = []
    for i in (1, 2):
        done = kvtool("trace", "run", str(WORKLOAD), "--connector", "mooncake", "--no-local-reuse",
                      "--output", str(tmp_path / f"run{i}"), *[a for p in pairs for a in ("--connector-opt", p)])
        assert done.returncode == 0, done.stderr[-3000:]
        summaries.append(json.loads((tmp_path / f"run{i}" / "summary.json").read_text()))
    first, second = summaries
    assert first["integrity_errors"] == second["integrity_errors"] == 0 and second["failed_requests"] == 0
    assert second["connector_hit_tokens"] > first["connector_hit_tokens"]
    assert second["computed_tokens"] < first["computed_tokens"] / 5


def remote_url(store):
    return f"mooncake://127.0.0.1:{store.rpc_port}?metadata={store.options['metadata']}"


def test_validate_mooncake_passes_with_the_remote_scenarios(store):
    """Two scenarios at a time (--jobs 2) against the one store: the remote-* ones run alone."""
    done = kvtool("validate", "mooncake", "--model", "tiny-vswa", "--jobs", "2", "--remote", remote_url(store),
                  "--format", "json", *[a for k, v in store.options.items() for a in ("--connector-opt", f"{k}={v}")])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    verdicts = {(c["scenario"], c["check"]): c["verdict"] for c in json.loads(done.stdout)["results"]}
    assert verdicts[("remote-lost-after-ask", "integrity")] == verdicts[("remote-lost-after-ask", "disrupted")] \
        == verdicts[("remote-restarted-empty", "integrity")] == "pass"
    assert verdicts[("remote-stalled", "integrity")] == "skip"        # Mooncake cannot pause its clients


def test_the_remote_scenarios_catch_a_fetch_at_load_connector_on_mooncake(store):
    done = kvtool("validate", "tests.helpers.broken_remote_connectors:MooncakeFetchAtLoad:MooncakeFetchAtLoadWorker",
                  "--model", "tiny", "--remote", remote_url(store), "--scenario", "remote-lost-after-ask",
                  "--format", "json", *[a for k, v in store.options.items() for a in ("--connector-opt", f"{k}={v}")])
    assert done.returncode == 1, done.stderr[-2000:]
    verdicts = {(c["scenario"], c["check"]): c["verdict"] for c in json.loads(done.stdout)["results"]}
    assert verdicts[("remote-lost-after-ask", "integrity")] == "fail"


def test_instances_sharing_mooncake_hit_each_others_prefixes(store, tmp_path):
    pairs = [a for k, v in opts(store).items() for a in ("--connector-opt", f"{k}={v}")]
    done = kvtool("trace", "run", str(WORKLOAD), "--instances", "2", "--connector", "mooncake", "--no-local-reuse",
                  "--output", str(tmp_path / "shared"), *pairs)
    assert done.returncode == 0, done.stderr[-3000:]
    shared = json.loads((tmp_path / "shared" / "instances.json").read_text())
    done = kvtool("trace", "run", str(WORKLOAD), "--instances", "2", "--connector", "host", "--no-local-reuse",
                  "--output", str(tmp_path / "local"))
    assert done.returncode == 0, done.stderr[-3000:]
    local = json.loads((tmp_path / "local" / "instances.json").read_text())
    assert [r["num_requests"] for r in shared["instances"]] == [12, 12]
    assert shared["all"]["integrity_errors"] == 0 and shared["all"]["failed_requests"] == 0
    assert shared["all"]["connector_hit_tokens"] > local["all"]["connector_hit_tokens"]
