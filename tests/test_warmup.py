"""`EngineConfig.warmup_seconds` / `kvtool validate --warmup`: the wait TensorRT-LLM's executor has
between the connector's setup and its first request. With none, a connector still setting up in
the background fails its first asks (what KVBM 1.6.1 did on kvtool, results/field-connectors-gpu);
with enough, the same connector serves."""

from __future__ import annotations

from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.connector.loader import ConnectorSpec
from kvtool.connector.request import Request
from kvtool.engine.engine import Engine, EngineConfig
from kvtool.engine.request_state import FailureReason
from kvtool.manager import KvCacheManagerConfig
from kvtool.models import load_model
from tests.helpers.late_ready_connector import READY_S, LateReady, Worker

runner = CliRunner()
SPEC = ConnectorSpec("late-ready", LateReady, Worker, "tests.helpers.late_ready_connector")


def _first_request_after(warmup: float):
    config = EngineConfig(KvCacheManagerConfig(load_model("tiny"), 4, num_slots=64, device="cpu"),
                          verify_all_after_iteration=True, warmup_seconds=warmup)
    engine = Engine(config, SPEC)
    state = engine.add_request(Request(0, list(range(100, 140)), 2))
    engine.run()
    return engine, state


def test_asked_at_once_a_connector_still_setting_up_fails_its_first_request():
    engine, state = _first_request_after(0.0)
    assert state.failure is FailureReason.ASK_RAISED
    assert "slot manager not initialized" in engine.connector.failures[0].describe()


def test_after_a_warmup_longer_than_its_setup_the_same_connector_serves():
    engine, state = _first_request_after(READY_S + 0.2)
    assert state.failure is None and len(state.request.generated_token_ids) == 2
    assert engine.integrity_errors == 0


def test_validate_takes_a_warmup_and_refuses_a_negative_one():
    target = "tests/helpers/late_ready_connector.py:LateReady:Worker"
    failed = runner.invoke(app, ["validate", target, "--model", "tiny", "--scenario", "cold-warm"])
    assert failed.exit_code == 1
    served = runner.invoke(app, ["validate", target, "--model", "tiny", "--scenario", "cold-warm", "--warmup", "0.5"])
    assert served.exit_code == 0, served.output
    refused = runner.invoke(app, ["validate", target, "--warmup", "-1"])
    assert refused.exit_code == 2 and "--warmup must be 0 to 600 seconds" in refused.output
