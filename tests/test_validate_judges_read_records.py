"""Validate's judges read a run's record and event log, never the engine: the modules that judge
import nothing of the engine but its events, nothing of the manager, and a record holds no engine
object."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import kvtool.validate
from kvtool.connector.runtime import ConnectorRuntime
from kvtool.connectors.registry import BUILTIN_CONNECTORS
from kvtool.engine.engine import Engine
from kvtool.engine.fake_engine import FakeEngine
from kvtool.engine.request_state import RequestState
from kvtool.manager.manager import KvCacheManager
from kvtool.validate.harness import Context, Req, run, tokens

VALIDATE = Path(kvtool.validate.__file__).parent
JUDGE_MODULES = ("judges.py", "scenarios.py", "pause_scenarios.py", "draft_scenarios.py", "remote_scenarios.py",
                 "reservation_scenarios.py", "runtime_differences.py",
                 "cause_evidence.py", "outlived_store.py")
ALLOWED_ENGINE_MODULES = {"kvtool.engine.events", "kvtool.engine.runtimes.names", "kvtool.engine.runtimes.behaviours"}
"""What the judges may read of the engine: its events, and the runtimes' names and behaviour table (data)."""


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports, at module level or anywhere else."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.update(f"{node.module}.{alias.name}" if node.module in ("kvtool", "kvtool.engine") else node.module
                         for alias in node.names)
    return found


def reads_engine_internals(module: str) -> bool:
    if module in ALLOWED_ENGINE_MODULES:
        return False
    return any(module == root or module.startswith(root + ".") for root in ("kvtool.engine", "kvtool.manager"))


def test_judge_modules_import_no_engine_internals():
    offending = {name: sorted(m for m in imports_of(VALIDATE / name) if reads_engine_internals(m))
                 for name in JUDGE_MODULES}
    assert {name: found for name, found in offending.items() if found} == {}


def test_the_check_sees_an_engine_import():
    assert reads_engine_internals("kvtool.engine.engine") and reads_engine_internals("kvtool.manager")
    assert reads_engine_internals("kvtool.engine.request_state")
    assert not reads_engine_internals("kvtool.engine.events")


def _values(value, depth: int = 0):
    """`value` and everything inside it: dataclass fields, mappings, sequences."""
    yield value
    if depth > 6:
        return
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        children = [getattr(value, f.name) for f in dataclasses.fields(value)]
    elif isinstance(value, dict):
        children = list(value.keys()) + list(value.values())
    elif isinstance(value, (list, tuple, set, frozenset)):
        children = list(value)
    else:
        children = []
    for child in children:
        yield from _values(child, depth + 1)


def test_a_run_record_holds_no_engine_object():
    ctx = Context(BUILTIN_CONNECTORS["host"], "tiny")
    prompt = tokens(1, 10 * ctx.tokens_per_block + 2)
    record = run(ctx, [Req(0, prompt), Req(1, prompt, arrival=1.0)])
    assert record.error is None and record.outcome(1).num_external > 0
    assert record.introspection is not None and record.introspection.tracked_request_ids == ()
    internals = (Engine, FakeEngine, RequestState, KvCacheManager, ConnectorRuntime,
                 BUILTIN_CONNECTORS["host"].scheduler_class, BUILTIN_CONNECTORS["host"].worker_class)
    fields = [getattr(record, f.name) for f in dataclasses.fields(record) if f.name != "events"]
    assert not [v for v in _values(fields) if isinstance(v, internals)]
