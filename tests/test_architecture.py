"""The package's structure: no module reaches itself again by any import, imports point down the
layers, and no module reads another's private names.

Every import counts — module level, inside a function, and under `TYPE_CHECKING` — because a
loop of any kind means two modules cannot be understood (or tested) one without the other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvtool

PACKAGE_ROOT = Path(kvtool.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """kvtool modules that `path` imports (a `from package import name` counts as the package,
    or as the module `package.name` when that is one)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if child in known else node.module)
    return {m for m in found if m in known}


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE_ROOT.rglob("*.py")}
    known = set(paths)
    # A package's __init__ re-exports its own modules; that is not a loop between modules.
    return {name: {m for m in imported_modules(path, known) if path.name != "__init__.py"
                   or not m.startswith(name + ".")} - {name}
            for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import loop as a list of modules (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_planted_loop():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_sees_function_level_and_type_checking_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvtool.types import Role\n"
                      "def f():\n    import kvtool.units\n")
    assert imported_modules(source, {"kvtool.types", "kvtool.units"}) == {"kvtool.types", "kvtool.units"}


def test_kvtool_has_no_import_loop():
    graph = import_graph()
    assert "kvtool.manager.kv_cache" in graph and graph["kvtool.manager.kv_cache"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


LAYERS = ("types", "errors", "blocks", "atomic_file", "group_pages", "units", "models", "manager", "transfer",
          "connector",
          "connectors", "inputs", "workloads", "engine", "bench", "validate", "report", "trace", "vllm_compat", "cli",
          "__main__")
"""Bottom-up, as ARCHITECTURE.md lists them: a module imports only from its own layer or one below."""


def layer_of(module: str) -> int:
    parts = module.split(".")
    return -1 if len(parts) == 1 else LAYERS.index(parts[1])


def test_every_import_points_down_the_layers():
    graph = import_graph()
    assert {m.split(".")[1] for m in graph if "." in m} == set(LAYERS)
    upward = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                    if layer_of(b) > layer_of(a) and layer_of(a) >= 0)
    assert upward == []


def top_level_imports(path: Path) -> set[str]:
    """The first component of every module `path` imports (absolute imports only)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_the_package_ships_no_study_tool_and_imports_no_test():
    """Studies of kvtool itself live in benchmarks/ (argparse scripts run from the repository root);
    the installed package reaches neither them nor tests/, and has one CLI framework (typer)."""
    offenders = {str(path.relative_to(PACKAGE_ROOT.parent)): sorted(found)
                 for path in PACKAGE_ROOT.rglob("*.py")
                 if (found := top_level_imports(path) & {"tests", "benchmarks", "argparse"})}
    assert offenders == {}


# ---- private names stay in their module --------------------------------------------------------
OUTSIDE_PRIVATE_NAMES = {"_exit", "_C", "_get_sm_carveout_experimental", "_replace", "_registry",
                         "_KV_CONNECTOR_AGENT", "_worker", "_sleep", "_target", "_shutdown", "_world", "_core",
                         "_set_madvise_hugepage", "_set_sm_carveout_experimental"}
"""Private names of other packages that kvtool uses on purpose: `os._exit` in a forked child,
torch's SM carve-out switches, a NamedTuple's `_replace`; vLLM's connector factory's registry (the
names it registers, which vLLM lists nowhere public) and its KV transfer agent (several workers
played in one process each become the agent in turn, where vLLM sets it once a process);
`concurrent.futures.thread._worker` (a connector's pool thread is known by its target, to hold it)
and `torch.cuda._sleep` (the device-side spin that makes the forward stream lose its races); read
through getattr with a default: a thread's `_target` and an executor's `_shutdown` (held work),
torch.distributed's `_world` (the default group's name), numpy's `_core`/`_set_madvise_hugepage`
(huge pages for growable arrays)."""


def private_names_defined(tree: ast.Module) -> set[str]:
    """Underscore names a module defines: functions, classes, class attributes, `self._x = ...`."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def foreign_private_reads(source: str) -> list[str]:
    """`x._name` or `getattr(x, "_name", ...)` where `x` is not self/cls and no code of this module
    defines `_name`."""
    tree = ast.parse(source)
    own = private_names_defined(tree) | OUTSIDE_PRIVATE_NAMES
    reads = [f"{node.lineno}: {ast.unparse(node)}" for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
             and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
             and node.attr not in own]
    by_name = [f"{node.lineno}: {ast.unparse(node)}" for node in ast.walk(tree)
               if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
               and len(node.args) >= 2
               and not (isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls"))
               and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
               and node.args[1].value.startswith("_") and not node.args[1].value.startswith("__")
               and node.args[1].value not in own]
    return reads + by_name


def test_the_private_name_finder_sees_a_planted_reach():
    planted = "def f(request):\n    return request._token_view()\n"
    own = "class A:\n    def _x(self):\n        return 1\n\ndef g(a: A):\n    return a._x()\n"
    assert foreign_private_reads(planted) == ["2: request._token_view"]
    assert foreign_private_reads("def f(r):\n    return getattr(r, '_token_view', None)\n") == \
        ["2: getattr(r, '_token_view', None)"]
    assert foreign_private_reads(own) == []


def test_no_module_reads_another_modules_private_names():
    package = Path(kvtool.__file__).parent
    reaches = {str(path.relative_to(package)): found for path in sorted(package.rglob("*.py"))
               if (found := foreign_private_reads(path.read_text()))}
    assert reaches == {}
