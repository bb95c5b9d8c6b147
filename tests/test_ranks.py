"""Ranks as real processes over torch.distributed (gloo): tensor-parallel shards, the same hits
as one rank, per-rank integrity, and a rank that dies or raises."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.connector.request import Request
from kvtool.connectors.metadata import StoreMetadata
from kvtool.connectors.registry import load_connector
from kvtool.engine.engine import Engine, EngineConfig
from kvtool.engine.events import EventLog, SaveFinished, SaveStarted
from kvtool.engine.pass_driver import PassPlan
from kvtool.engine.pass_types import PassItem
from kvtool.engine.ranks import FinishedOrder, PassOrder, RankExecutor, RankGroupError, RankSetup
from kvtool.engine.scheduler import SchedulerConfig
from kvtool.manager import KvCacheManagerConfig
from kvtool.models import load_model
from kvtool.trace.replay import run_trace
from kvtool.validate.harness import Context
from kvtool.validate.runner import run_all
from kvtool.workloads.source import load_workload
from tests.helpers.rank_connectors import SlowRank1

runner = CliRunner()
WORKLOAD = Path("workloads/shared_prefix.jsonl")
HITS = ("local_hit_tokens", "connector_hit_tokens", "computed_tokens", "loaded_blocks", "saved_blocks")


def replay(connector: str, num_ranks: int, tp: int, options: dict | None = None):
    config = EngineConfig(KvCacheManagerConfig(load_model("tiny"), 32, num_slots=512, device="cpu"),
                          SchedulerConfig(local_reuse=False), num_ranks=num_ranks, tp_size=tp,
                          ranks_as_processes=True)
    return run_trace(load_workload(WORKLOAD), config, load_connector(connector), options or {})


@pytest.fixture(scope="module")
def one_rank_host():
    return replay("host", 1, 1).summary.as_dict()


def test_two_tensor_parallel_ranks_serve_what_one_rank_serves(one_rank_host):
    two = replay("host", 2, 2).summary.as_dict()
    assert two["integrity_errors"] == 0 and two["failed_requests"] == 0
    assert {k: two[k] for k in HITS} == {k: one_rank_host[k] for k in HITS}
    assert one_rank_host["connector_hit_tokens"] > 0


def test_replicated_ranks_generate_the_same_tokens_as_one(one_rank_host):
    two = replay("host", 2, 1).summary.as_dict()
    assert two["integrity_errors"] == 0 and {k: two[k] for k in HITS} == {k: one_rank_host[k] for k in HITS}


def test_disk_shards_live_beside_each_other_in_one_folder(tmp_path, one_rank_host):
    options = {"dir": str(tmp_path)}
    first = replay("disk", 2, 2, options).summary.as_dict()
    assert first["integrity_errors"] == 0 and {k: first[k] for k in HITS} == {k: one_rank_host[k] for k in HITS}
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2    # one layout signature per shard
    second = replay("disk", 2, 2, options).summary.as_dict()
    assert second["integrity_errors"] == 0 and second["connector_hit_tokens"] > first["connector_hit_tokens"]


def test_ranks_that_share_one_shards_files_are_caught_with_rank_and_global_head(tmp_path):
    """Both ranks read and write the files the scheduler named (rank 0's): whichever rank wrote a
    file first, the other rank loads heads that are not its own."""
    spec = "tests.helpers.rank_connectors:DiskConnectorScheduler:ReadsRank0Files"
    result = replay(spec, 2, 2, {"dir": str(tmp_path)})
    assert result.summary.integrity_errors > 0
    engine_issues = [line for line in result.issues if "mismatch" in line]
    assert all(("head 1:" in line) == line.startswith("rank 1, ") for line in engine_issues), engine_issues[:3]


def test_a_rank_that_dies_ends_the_run_naming_it_and_its_hook():
    result = runner.invoke(app, ["trace", "run", str(WORKLOAD), "--num-ranks", "2", "--no-local-reuse", "--connector",
                                 "tests.helpers.rank_connectors:HostConnectorScheduler:DiesOnRank1"])
    assert result.exit_code == 1, result.output
    assert "rank 1 ended (exit code 7) during start_load_kv" in result.output and "Traceback" not in result.output


def test_a_follower_that_cannot_be_built_is_one_line_naming_it_its_stage_and_the_connectors_line():
    """In a process of its own: a follower's traceback would go to the terminal, past CliRunner."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "kvtool", "trace", "run", str(WORKLOAD), "--num-ranks", "2",
                           "--connector", "tests.helpers.rank_connectors:HostConnectorScheduler:UnbuildableOnRank1"],
                          capture_output=True, text=True, timeout=120)
    line = next(i for i, text in enumerate(Path("tests/helpers/rank_connectors.py").read_text().splitlines(), 1)
                if "rank 1 has no store" in text)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines()[-1] == (
        "kvtool: error: rank 1 ended (exit code 1) during constructing the worker: ValueError: rank 1 has no store "
        f"({Path('tests/helpers/rank_connectors.py').resolve()}:{line})")


def test_a_follower_that_cannot_import_the_connector_ends_the_run_at_once_in_one_line():
    """The follower dies before it reaches the rendezvous: rank 0 says so as soon as it is gone,
    instead of waiting out the group's 60 s timeout (the subprocess limit is below it)."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "kvtool", "trace", "run", str(WORKLOAD), "--num-ranks", "2",
                           "--connector", "tests.helpers.main_process_only:Scheduler:Worker"],
                          capture_output=True, text=True, timeout=45)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    helper = Path("tests/helpers/main_process_only.py").resolve()
    line = next(i for i, text in enumerate(helper.read_text().splitlines(), 1) if "raise ImportError" in text)
    assert done.stderr.splitlines()[-1] == ("kvtool: error: rank 1 ended (exit code 1) during importing the "
                                            "connector: ImportError: main_process_only refuses a child process "
                                            f"({helper}:{line})"), done.stderr


def test_a_hook_that_raises_on_one_rank_fails_its_requests_on_all():
    result = replay("tests.helpers.rank_connectors:HostConnectorScheduler:RaisesOnRank1", 2, 2)
    summary = result.summary
    assert summary.failed_requests > 0 and summary.integrity_errors == 0 and summary.hook_failures > 0
    assert any("start_load_kv (rank 1) raised RuntimeError: rank 1 cannot reach its store" in line
               for line in result.issues), result.issues[:3]


@pytest.mark.parametrize(("args", "words"), [(["--tp", "2"], "--tp 2 needs --num-ranks 2"),
                                              (["--tp", "3", "--num-ranks", "3"], "does not divide the 2 KV heads")])
def test_impossible_rank_layouts_are_exit_2(args, words):
    result = runner.invoke(app, ["trace", "run", str(WORKLOAD), *args])
    assert result.exit_code == 2 and words in result.output


def test_the_followers_are_gone_after_the_run():
    config = EngineConfig(KvCacheManagerConfig(load_model("tiny"), 32, num_slots=64, device="cpu"),
                          num_ranks=2, tp_size=2, ranks_as_processes=True)
    engine = Engine(config, load_connector("host"))
    processes = list(engine.group.followers._processes)
    engine.close()
    assert all(not p.is_alive() and p.exitcode == 0 for p in processes)


def validate_two_ranks(target: str, scenarios: list[str], load_timeout: float = 5.0):
    """The load timeout is validate's default: a load that lands is never timed out by a loaded machine;
    a test whose loads never land shortens it (the timeout is then what it waits for)."""
    spec = load_connector(target)
    contexts = [Context(spec, m, load_timeout=load_timeout, num_ranks=2, tp_size=2) for m in ("tiny", "tiny-vswa")]
    return run_all(contexts, scenarios, 300, isolated=False)


@pytest.mark.parametrize(("worker", "check", "scenario"), [
    ("LoadsReportedOnRank0Only", "load-completes", "async-load"),
    ("OtherPlanOnRank1", "integrity", "cold-warm"),
    ("SaveNeverLandsOnRank1", "integrity", "cold-warm"),
])
def test_validate_with_two_ranks_catches_a_defect_on_one_rank(worker, check, scenario):
    scheduler = "AsyncScheduler" if worker == "LoadsReportedOnRank0Only" else "HostConnectorScheduler"
    results = validate_two_ranks(f"tests.helpers.rank_connectors:{scheduler}:{worker}", [scenario],
                                 load_timeout=1.0 if check == "load-completes" else 5.0)
    failed = {(r.scenario, r.check) for r in results if r.failed}
    assert (scenario, check) in failed, [(r.scenario, r.check, r.evidence[:2]) for r in results]
    if check == "integrity":
        evidence = " ".join(e for r in results if r.failed for e in r.evidence)
        assert "rank 1, request" in evidence and "rank 0" not in evidence


def test_a_rank_that_reports_late_is_waited_for_and_passes():
    results = validate_two_ranks("tests.helpers.rank_connectors:AsyncScheduler:SlowRank1",
                                 ["async-load", "async-save", "cold-warm"])
    assert not [r for r in results if r.failed], [(r.scenario, r.check, r.evidence[:2]) for r in results if r.failed]
    assert {r.check for r in results} >= {"load-completes", "finished-ids", "integrity"}


def test_the_runtime_acts_on_a_save_only_once_the_slowest_rank_reported():
    spec = load_connector("tests.helpers.rank_connectors:AsyncScheduler:SlowRank1")
    config = EngineConfig(KvCacheManagerConfig(load_model("tiny"), 4, num_slots=64, device="cpu",
                                               poison_new_pages=True),
                          num_ranks=2, tp_size=2, ranks_as_processes=True)
    engine = Engine(config, spec)
    log = EventLog()
    engine.events.subscribe(log)
    engine.add_request(Request(0, list(range(1, 30)), 2))
    try:
        engine.run()
    finally:
        engine.close()
    (started,) = log.of(SaveStarted)
    (finished,) = log.of(SaveFinished)
    assert finished.iteration - started.iteration >= SlowRank1.DELAY
    assert engine.integrity_errors == 0


def test_a_rank_that_hangs_is_named_with_its_hook_after_the_timeout():
    """The timeout also bounds the follower's start (a spawned process importing torch) and every
    earlier answer: 20 s, so that on a loaded machine only the hang reaches it."""
    config = EngineConfig(KvCacheManagerConfig(load_model("tiny"), 32, num_slots=512, device="cpu"),
                          SchedulerConfig(local_reuse=False), num_ranks=2, ranks_as_processes=True, rank_timeout_s=20)
    with pytest.raises(RankGroupError, match=r"rank 1 did not answer within 20 s \(in wait_for_save\)"):
        run_trace(load_workload(WORKLOAD), config,
                  load_connector("tests.helpers.rank_connectors:HostConnectorScheduler:HangsOnRank1"), {})


def test_a_follower_that_hangs_before_joining_is_named_with_its_stage_after_the_timeout():
    config = EngineConfig(KvCacheManagerConfig(load_model("tiny"), 4, num_slots=64, device="cpu"),
                          num_ranks=2, ranks_as_processes=True, rank_timeout_s=30)
    spec = load_connector("tests.helpers.slow_import_in_child:Scheduler:Worker")   # its import sleeps 60 s
    # 30 s: the spawned follower reaches the connector's import (after torch's) on a loaded machine too
    with pytest.raises(RankGroupError, match=r"^rank 1 did not start within 30 s \(in importing the connector\)$"):
        Engine(config, spec)


def test_a_follower_verifies_the_idle_requests_pages_it_is_sent():
    setup = RankSetup(KvCacheManagerConfig(load_model("tiny"), 4, num_slots=8, device="cpu"), (8,), 2, 2, 0, None,
                      (), 0, 1.0)
    follower = RankExecutor(1, setup)
    tokens = list(range(1, 10))
    written = PassItem(5, tokens, [[0, 1, 2]], 0, 9, False)
    clean = follower.run(PassOrder(1, None, [], [written], [], PassPlan(False, True), [replace(written, end=9)]))
    assert not clean.errors_by_request
    follower.manager.poison_slot(0, 1)      # a stray write into an idle request's page
    dirty = follower.run(PassOrder(2, None, [], [], [], PassPlan(False, True), [replace(written, end=9)]))
    assert dirty.errors_by_request[5] > 0 and {i.block_ordinal for i in dirty.issues} == {1}
    assert {i.head for i in dirty.issues} == {1}     # rank 1 of 2 holds global head 1


def test_a_follower_hands_its_worker_a_stream_and_reports_a_raising_get_finished_as_not_ok():
    spec = load_connector("tests.helpers.rank_connectors:HostConnectorScheduler:SyncsAndFailsFinishedOnRank1")
    setup = RankSetup(KvCacheManagerConfig(load_model("tiny"), 4, num_slots=8, device="cpu"), (8,), 2, 2, 0, spec,
                      (), 0, 1.0)
    follower = RankExecutor(1, setup)
    report = follower.run(PassOrder(1, StoreMetadata(), [], [], [], PassPlan(starts=True, forwards=False)))
    assert report.failures == []                                             # start_load_kv's synchronize ran
    report = follower.run(FinishedOrder([], [], [], []))
    assert report.finished == (False, None)
    assert [hook for hook, _ in report.failures] == ["get_finished (rank 1)"]


def test_the_rank_overhead_bench_still_drives_the_followers():
    """`python -m benchmarks.rank_overhead` builds orders by hand: it broke once when PassOrder changed."""
    from benchmarks.rank_overhead import empty_round_trip_us
    assert empty_round_trip_us(2, repeats=3) > 0


def test_a_follower_whose_group_fails_after_the_rendezvous_is_named_at_once_not_after_the_timeout(monkeypatch):
    """It set its joined mark, then its init_process_group raised and it ended: rank 0, inside its
    own init_process_group, would wait the whole timeout for it."""
    from kvtool.engine import ranks
    from tests.helpers.failing_follower import REFUSAL, follow_whose_group_fails
    monkeypatch.setattr(ranks, "follow", follow_whose_group_fails)
    setup = RankSetup(KvCacheManagerConfig(load_model("tiny"), 4, num_slots=8, device="cpu"), (8,), 1, 2, 0, None,
                      (), 0, 300.0)
    started = time.monotonic()
    with pytest.raises(RankGroupError, match=rf"^rank 1 ended \(exit code 1\) during joining rank 0: .*{REFUSAL}"):
        ranks.Followers(setup)
    assert time.monotonic() - started < setup.timeout_s, "waited for the timeout"
    monkeypatch.undo()                 # healthy followers again: this process forms a group at once,
    # not once the abandoned join's 300 s are over (it would then time out at 120 s)
    followers = ranks.Followers(replace(setup, timeout_s=120.0))
    assert torch.distributed.is_initialized() and torch.distributed.get_world_size() == 2
    followers.close()                  # its stop order reaches the follower: it ends with exit code 0
    assert [process.exitcode for process in followers._processes] == [0]
