"""validate's evidence reads at once: poison said in words, the connector's own line for an error
kvtool raised on its behalf, every failure's whole traceback kept (--output DIR), knock-on failures
named as such, the remote rows skipped for want of --remote folded into one table line."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.connector.loader import ConnectorSpec
from kvtool.connector.raised import with_wrapped_location
from kvtool.connector.runtime import ConnectorRuntime, HookFailure
from kvtool.connectors.host import HostConnectorScheduler, HostConnectorWorker
from kvtool.connectors.redis_connector import RedisConnectorScheduler, RedisConnectorWorker
from kvtool.engine.engine import Engine
from kvtool.engine.ranks import RankExecutor, RankReport, RankSetup
from kvtool.errors import ConstructionError
from kvtool.manager import KvCacheManagerConfig
from kvtool.models import load_model
from kvtool.validate.harness import Context, engine_config
from kvtool.validate.judges import knock_on
from kvtool.validate.run_record import RunRecord
from kvtool.validate.runner import run_all
from tests.helpers.managers import make_manager
from tests.helpers.servers import RedisServer, need_redis

runner = CliRunner()
HERE = str(Path(__file__).resolve())
MODULE = "tests.test_validate_evidence"


def line_marked(mark: str) -> int:
    """The line of this file that ends with `# <mark>`."""
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.rstrip().endswith(f"# {mark}"))


def validate_tiny(scheduler, worker, scenarios, **context):
    spec = ConnectorSpec("under-test", scheduler, worker, MODULE)
    return run_all([Context(spec, "tiny", **context)], scenarios, 60, isolated=False)


def only(results, scenario, check):
    (r,) = [r for r in results if r.scenario == scenario and r.check == check]
    return r


# ---- the connectors under test ---------------------------------------------------------------
class SavesBeforeTheForward(HostConnectorWorker):
    """Saves a pass's blocks at start_load_kv, before the forward pass writes them."""

    def start_load_kv(self, stream):
        if self.meta.saves:
            self.save(self.meta.saves)
        super().start_load_kv(stream)

    def wait_for_save(self, stream):
        pass


class LoadsThroughMinusOne(HostConnectorWorker):
    """Reads page -1 (BAD_PAGE_INDEX) whenever it has something to load: slot_tensor raises."""

    def start_load_kv(self, stream):
        if self.meta.loads:
            self.layout.group(0).regions[0].slot_tensor(-1)  # bad-call
        super().start_load_kv(stream)


class StoreUnreachable(HostConnectorWorker):
    """Every pass's start_load_kv raises: no later hook of any pass runs."""

    def start_load_kv(self, stream):
        raise RuntimeError("cannot reach the store")  # store-unreachable


class RefusesToBuild(HostConnectorScheduler):
    def __init__(self, llm_args):
        raise ValueError("no capacity configured")  # bad-constructor


# ---- 1. poison in words -------------------------------------------------------------------------
def test_a_load_of_poison_says_what_the_page_was_before_its_bytes():
    results = validate_tiny(HostConnectorScheduler, SavesBeforeTheForward, ["cold-warm"])
    integrity = only(results, "cold-warm", "integrity")
    assert integrity.failed
    assert "found a page that was never written since it was handed out (a5a5a5a5a5a5a5a5)" in \
        integrity.evidence[0], integrity.evidence


def test_a_wrong_byte_says_where_its_position_came_from():
    """The warm request's bytes came through the connector: the evidence says which delivery."""
    results = validate_tiny(HostConnectorScheduler, SavesBeforeTheForward, ["cold-warm"])
    first = only(results, "cold-warm", "integrity").evidence[0]
    assert "; this position was loaded by the connector (tokens [0, " in first, first
    assert ") delivered in iteration " in first and first.endswith("its load wrote wrong bytes, or its store held them")


# ---- 2. the connector's file and line -----------------------------------------------------------
def test_an_index_error_raised_inside_kvtool_names_the_connectors_line():
    results = validate_tiny(HostConnectorScheduler, LoadsThroughMinusOne, ["cold-warm"])
    integrity = only(results, "cold-warm", "integrity")
    where = f"({HERE}:{line_marked('bad-call')}, raised inside kvtool's slot_tensor)"
    assert integrity.failed and "IndexError: page index -1" in integrity.evidence[0]
    assert where in integrity.evidence[0], integrity.evidence
    assert "kvtool/manager/layout.py" not in integrity.evidence[0]


def _reads_page_minus_one(manager):
    manager.layout.group(0).regions[0].slot_tensor(-1)  # guarded-call


def test_both_hook_guards_blame_the_connectors_line_and_keep_the_traceback():
    manager = make_manager("tiny", 4, num_slots=8)
    where = f"({HERE}:{line_marked('guarded-call')}, raised inside kvtool's slot_tensor)"
    runtime = ConnectorRuntime(None, [])
    assert runtime.call("start_load_kv", _reads_page_minus_one, manager) == (False, None)
    (failure,) = runtime.failures
    assert failure.error.endswith(where), failure.error
    assert failure.traceback.startswith("Traceback (most recent call last)") and "in slot_tensor" in \
        failure.traceback and failure.traceback.rstrip().endswith("IndexError: page index -1 outside [0, 8)")
    setup = RankSetup(KvCacheManagerConfig(load_model("tiny"), 4, num_slots=8, device="cpu"), (8,), 2, 2, 0, None,
                      (), 0, 1.0)
    follower = RankExecutor(1, setup)
    follower._report = report = RankReport(1)
    assert follower._call("start_load_kv", _reads_page_minus_one, follower.manager) == (False, None)
    ((hook, error),), (text,) = report.failures, report.tracebacks
    assert hook == "start_load_kv" and error == failure.error
    assert "in slot_tensor" in text and f'File "{HERE}", line {line_marked("guarded-call")}' in text


def test_an_error_of_kvtool_itself_keeps_kvtools_line():
    runtime = ConnectorRuntime(None, [])
    runtime.call("build_connector_meta", load_model, "no-such-model")
    assert "kvtool/models.py:" in runtime.failures[0].error, runtime.failures[0].error


def test_a_constructor_exception_names_its_line(tmp_path):
    spec = ConnectorSpec("refuses", RefusesToBuild, HostConnectorWorker, MODULE)
    with pytest.raises(ConstructionError) as raised:
        Engine(engine_config(Context(spec, "tiny"), 8, None, False, 8), spec, {})
    assert with_wrapped_location(raised.value).endswith(f"({HERE}:{line_marked('bad-constructor')})")
    file = tmp_path / "refusing.py"
    file.write_text("from kvtool.connectors.host import HostConnectorScheduler, HostConnectorWorker\n"
                    "class S(HostConnectorScheduler):\n"
                    "    def __init__(self, llm_args):\n"
                    "        raise ValueError('no capacity configured')\n")
    result = runner.invoke(app, ["validate", f"{file}:S:HostConnectorWorker", "--model", "tiny",
                                 "--scenario", "cold-warm"])
    assert result.exit_code == 2, result.output
    assert f"ValueError: no capacity configured ({file}:4)" in result.stderr, result.stderr
    assert "Traceback" not in result.output


# ---- 3. every failure's traceback ---------------------------------------------------------------
def test_each_hook_failures_whole_traceback_travels_with_the_results():
    results = validate_tiny(HostConnectorScheduler, LoadsThroughMinusOne, ["cold-warm"])
    integrity = only(results, "cold-warm", "integrity")
    (text,) = integrity.tracebacks          # two failures, one traceback: counted, not repeated
    head, _, body = text.partition("\n")
    assert head.startswith("start_load_kv (rank 0) raised IndexError") and head.endswith("(2 times)"), head
    assert body.startswith("Traceback (most recent call last)") and f'File "{HERE}"' in body and \
        "in address_of" in body
    assert not any(r.tracebacks for r in results if r is not integrity)


def test_validate_output_writes_every_traceback_and_the_table_keeps_one_line(tmp_path):
    file = tmp_path / "minus_one.py"
    file.write_text("from kvtool.connectors.host import HostConnectorScheduler, HostConnectorWorker\n"
                    "class W(HostConnectorWorker):\n"
                    "    def start_load_kv(self, stream):\n"
                    "        if self.meta.loads:\n"
                    "            self.layout.group(0).regions[0].slot_tensor(-1)\n"
                    "        super().start_load_kv(stream)\n")
    out = tmp_path / "run"
    result = runner.invoke(app, ["validate", f"{file}:HostConnectorScheduler:W", "--model", "tiny",
                                 "--scenario", "cold-warm", "--runtime", "trtllm-v2-release", "--output", str(out)])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.stdout and 'File "' not in result.stdout    # the table: evidence only
    written = (out / "tracebacks" / "cold-warm-tiny-trtllm-v2-release.txt").read_text()
    assert "Traceback (most recent call last)" in written and f'File "{file}", line 5, in start_load_kv' in written
    assert "IndexError: page index -1" in written and "tracebacks of 1 failures" in result.stderr
    document = json.loads((out / "results.json").read_text())
    assert [r["tracebacks"] for r in document["results"] if r["tracebacks"]] == [[written.rstrip("\n")]]
    assert "tracebacks" not in (out / "results.csv").read_text().splitlines()[0]
    errs = [e.text for e in ET.parse(out / "junit.xml").getroot().iter("system-err")]
    assert len(errs) == 1 and "in slot_tensor" in errs[0]


def test_a_passing_run_writes_no_tracebacks(tmp_path):
    """hook-raises injects a failure of its own: not the connector's, not kept when all passed."""
    out = tmp_path / "run"
    result = runner.invoke(app, ["validate", "host", "--model", "tiny", "--scenario", "hook-raises",
                                 "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert not (out / "tracebacks").exists()


# ---- 4. knock-on failures -----------------------------------------------------------------------
def test_knock_on_names_the_earlier_failure():
    failure = HookFailure("start_load_kv", None, "RuntimeError: cannot reach the store (my.py:3)")
    assert knock_on(RunRecord(failures=(failure,)), "no failure could be injected") == (
        "knock-on: no failure could be injected, because of an earlier failure: start_load_kv raised "
        "RuntimeError: cannot reach the store (my.py:3)")
    assert knock_on(RunRecord(error="LogicError: x (engine.py:1)"), "nothing offered") == \
        "knock-on: nothing offered, because of an earlier failure: the run stopped: LogicError: x (engine.py:1)"
    assert knock_on(RunRecord(), "no failure could be injected") == "no failure could be injected"


def test_no_injected_failure_is_a_knock_on_of_the_connectors_own():
    results = validate_tiny(HostConnectorScheduler, StoreUnreachable, ["hook-raises"])
    survival = only(results, "hook-raises", "survives-hook-failure")
    assert survival.evidence[0] == ("knock-on: no failure could be injected, because of an earlier failure: "
                                    "start_load_kv (rank 0) raised RuntimeError: cannot reach the store "
                                    f"({HERE}:{line_marked('store-unreachable')})"), survival.evidence


class AskRaises(RedisConnectorScheduler):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        raise ConnectionError("the index is gone")  # ask-raises


def test_a_remote_scenario_with_nothing_to_disrupt_says_it_is_a_knock_on():
    need_redis()
    server = RedisServer().start()
    try:
        results = validate_tiny(AskRaises, RedisConnectorWorker, ["remote-lost-after-ask"],
                                options=(("url", server.url),), remote=server.url)
    finally:
        server.stop()
    disrupted = only(results, "remote-lost-after-ask", "disrupted")
    assert disrupted.failed
    assert disrupted.evidence[0].startswith(
        "knock-on: the connector offered nothing, so there was no ask→load window to disrupt, because of an "
        "earlier failure: get_num_new_matched_tokens for request 0 raised ConnectionError: the index is gone "
        f"({HERE}:{line_marked('ask-raises')})"), disrupted.evidence


# ---- 5. skipped remote rows, one line -----------------------------------------------------------
def test_remote_rows_skipped_for_want_of_remote_fold_into_one_line():
    args = ["validate", "host", "--model", "tiny", "--scenario", "remote-stalled", "--scenario",
            "remote-lost-after-ask", "--scenario", "remote-connections-dropped", "--runtime", "trtllm-v2-release"]
    folded = runner.invoke(app, args)
    assert folded.exit_code == 0, folded.output
    assert "remote-* (3 scenarios × 1 model)" in folded.stdout and "needs --remote URL" in folded.stdout
    assert "remote-stalled" not in folded.stdout
    every = runner.invoke(app, args + ["--verbose"])
    assert all(name in every.stdout for name in ("remote-stalled", "remote-lost-after-ask",
                                                 "remote-connections-dropped"))
    assert "remote-* (" not in every.stdout
    document = json.loads(runner.invoke(app, args + ["--format", "json"]).stdout)
    assert [r["scenario"] for r in document["results"] if r["verdict"] == "skip"] == [
        "remote-stalled", "remote-lost-after-ask", "remote-connections-dropped"]
