"""A connector built on a native extension fails the way a Python one does: a Rust panic reaches
Python as pyo3's `PanicException`, which derives from `BaseException`, not `Exception` (NVIDIA
Dynamo's KVBM 1.6.1 panics so when its leader is asked before its worker registered). kvtool's hook
guards record it as the connector's failure instead of letting it end the run with a traceback;
Ctrl-C still stops kvtool."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.connector.loader import ConnectorSpec
from kvtool.connector.request import Request
from kvtool.engine.request_state import Phase
from kvtool.errors import ConstructionError, InputError
from tests.helpers.connectors import OracleWorker, ScriptedScheduler
from tests.helpers.engines import make_engine


class PanicException(BaseException):
    """What pyo3 raises for a Rust panic (its own class derives from BaseException too)."""


class _PanicsWhenAsked(ScriptedScheduler):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        raise PanicException("slot_manager not initialized")


class _InterruptedWhenAsked(ScriptedScheduler):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        raise KeyboardInterrupt


class _PanicsWhenBuilt(ScriptedScheduler):
    def __init__(self, llm_args):
        raise PanicException("At least one cache tier must be configured.")


class _PanicsWhenRegistered(OracleWorker):
    def register_kv_cache_layout(self, layout):
        raise PanicException("no CUDA device")


class _PanicsInThePass(OracleWorker):
    def start_load_kv(self, stream):
        raise PanicException("CUDA event on a CPU tensor")


def _spec(scheduler=ScriptedScheduler, worker=OracleWorker):
    return ConnectorSpec("native", scheduler, worker, __name__)


def test_a_panic_in_the_ask_fails_that_request_and_names_it():
    engine = make_engine(_spec(_PanicsWhenAsked))
    engine.add_request(Request(1, list(range(9)), 2))
    engine.run()
    assert engine.states[1].phase is Phase.FAILED
    (failure, *_) = engine.connector.failures
    assert (failure.hook, failure.request_id) == ("get_num_new_matched_tokens", 1)
    assert failure.error.startswith("PanicException: slot_manager not initialized (")


def test_a_panic_in_a_worker_hook_fails_the_pass_not_the_run():
    engine = make_engine(_spec(worker=_PanicsInThePass))
    engine.add_request(Request(1, list(range(9)), 2))
    engine.run()
    assert engine.states[1].phase is Phase.FAILED
    assert any(f.hook.startswith("start_load_kv") and f.error.startswith("PanicException: CUDA event")
               for f in engine.connector.failures)


def test_a_panic_while_constructing_or_registering_is_one_line():
    with pytest.raises(ConstructionError, match="could not be constructed: PanicException: At least one cache tier"):
        make_engine(_spec(_PanicsWhenBuilt))
    with pytest.raises(InputError, match="registering the KV cache failed: PanicException: no CUDA device"):
        make_engine(_spec(worker=_PanicsWhenRegistered))


def test_ctrl_c_in_a_hook_still_stops_kvtool():
    engine = make_engine(_spec(_InterruptedWhenAsked))
    engine.add_request(Request(1, list(range(9)), 2))
    with pytest.raises(KeyboardInterrupt):
        engine.run()


def test_validate_says_a_constructor_panicked_not_that_it_exited():
    target = f"{__file__}:_PanicsWhenBuilt:OracleWorker"
    result = CliRunner().invoke(app, ["validate", target, "--model", "tiny"])
    assert result.exit_code == 2, result.output
    assert f"connector {target!r} could not be constructed: PanicException: At least one cache tier" in result.stderr
    assert "must raise, not exit" not in result.stderr
