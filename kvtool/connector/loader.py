"""Finding a connector: a registered name, `MODULE:SCHED:WORKER`, or `path/to/file.py:SCHED:WORKER`.

This layer knows no connector by name: `kvtool.connectors.registry` passes its built-ins in.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvtool.connector.api import KvCacheConnectorScheduler, KvCacheConnectorWorker
from kvtool.connector.compat import install_compat
from kvtool.connector.introspection import retired_hook_error
from kvtool.errors import InputError, did_you_mean


@dataclass(frozen=True)
class ConnectorSpec:
    name: str
    scheduler_class: type
    worker_class: type
    module: str
    options: Mapping[str, str] = field(default_factory=dict)
    compat: str | None = None
    """The `--compat` modules (`kvtool.connector.compat`) its module imports."""

    def __reduce__(self):
        # A connector imported from a file lives in a module no other process can import by
        # name, and one written against another runtime needs its compat modules first: such a
        # spec travels as its target and is imported again on arrival.
        if self.module.startswith(FILE_MODULE_PREFIX) or self.compat is not None:
            return _from_target, (self.name, dict(self.options), self.compat)
        return ConnectorSpec, (self.name, self.scheduler_class, self.worker_class, self.module, dict(self.options))


FILE_MODULE_PREFIX = "kvtool_connector_"


def _from_target(target: str, options: dict[str, str], compat: str | None) -> ConnectorSpec:
    spec = load_connector(target, {}, compat)
    return ConnectorSpec(spec.name, spec.scheduler_class, spec.worker_class, spec.module, options, compat)


def load_connector(target: str, registered: Mapping[str, ConnectorSpec], compat: str | None = None) -> ConnectorSpec:
    """The connector `target` names: one of `registered`, or imported from a module or file
    (after installing the `compat` modules); InputError (with the import error, and the closest
    name where one was mistyped) when it cannot be."""
    if target in registered:
        return registered[target]
    install_compat(compat)
    parts = target.rsplit(":", 2)
    if len(parts) == 2 and all(parts):
        form = "FILE.py:SCHED:WORKER" if parts[0].endswith(".py") else "MODULE:SCHED:WORKER"
        raise InputError(f"connector {target!r}: the worker class is missing: give {form} "
                         f"(e.g. {target}:MyWorker)")
    if len(parts) != 3 or not all(parts):
        hint = did_you_mean(target, registered) if ":" not in target else ""
        raise InputError(f"connector {target!r} is not a built-in{hint}: use a built-in ({', '.join(registered)}), "
                         "MODULE:SCHED:WORKER or path/to/file.py:SCHED:WORKER")
    where, sched, worker = parts
    if where.endswith(".py"):
        module, shown = _import_file(where, target, compat), where
    else:
        module = _import_module(where, target, compat)
        shown = module.__name__
    return _spec(target, module, shown, sched, worker, {}, compat)


def _spec(target: str, module, shown: str, sched: str, worker: str, options: dict[str, str],
          compat: str | None) -> ConnectorSpec:
    """`shown` names the module in errors: the file as the user gave it, or the module's name."""
    classes = []
    for name, base in ((sched, KvCacheConnectorScheduler), (worker, KvCacheConnectorWorker)):
        cls = getattr(module, name, None)
        if not isinstance(cls, type):
            raise InputError(f"connector {target!r}: {shown} has no class {name}"
                             f"{did_you_mean(name, _class_names(module, base), cutoff=0.5)}")
        if not issubclass(cls, base) and not _looks_like(cls, base):
            raise InputError(f"connector {target!r}: {name} is not a {base.__name__}")
        classes.append(cls)
    if (retired := retired_hook_error(classes[0])) is not None:
        raise InputError(f"connector {target!r}: {retired}")
    return ConnectorSpec(target, classes[0], classes[1], module.__name__, options, compat)


def _class_names(module, base: type) -> list[str]:
    """The classes `module` holds that could play `base`'s part (every class, when none could)."""
    classes = {n: c for n, c in vars(module).items() if isinstance(c, type) and not n.startswith("_")}
    fitting = [n for n, c in classes.items() if c is not base and (issubclass(c, base) or _looks_like(c, base))]
    return fitting or list(classes)


def _looks_like(cls: type, base: type) -> bool:
    """A class written against another runtime's base classes (same method names) is accepted."""
    names = [n for n in vars(base)
             if not n.startswith("_") and getattr(getattr(base, n), "__isabstractmethod__", False)]
    return all(callable(getattr(cls, n, None)) for n in names)


_COMPAT_OF_PACKAGE = {"tensorrt_llm": ("TensorRT-LLM", "trtllm")}
"""Runtime packages a `--compat` provides: the runtime's name and the `--compat` value."""


def _compat_hint(exc: Exception, compat: str | None) -> str:
    """" (... add --compat NAME)" when `exc` is a missing package that a `--compat` not given
    provides (a submodule of it included), else ""."""
    if compat is not None or not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return ""
    runtime = _COMPAT_OF_PACKAGE.get(exc.name.split(".")[0])
    return f" (a connector written against {runtime[0]}: add --compat {runtime[1]})" if runtime else ""


def _import_module(name: str, target: str, compat: str | None):
    try:
        return importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - any import-time failure is the target's, reported in one line
        hint = _compat_hint(exc, compat)
        if isinstance(exc, ModuleNotFoundError) and exc.name is not None and \
                (name == exc.name or name.startswith(exc.name + ".")):
            file = Path(*name.split(".")).with_suffix(".py")
            if file.is_file():   # `myconn:S:W` typed next to myconn.py: the module is not on sys.path
                hint = f" (did you mean {file}:{target[len(name) + 1:]}, the file in this folder?)"
        raise InputError(f"connector {target!r}: cannot import {name}: {type(exc).__name__}: {exc}{hint}") from None


def _import_file(path: str, target: str, compat: str | None):
    file = Path(path)
    if not file.is_file():
        raise InputError(f"connector {target!r}: no file {path}")
    name = f"{FILE_MODULE_PREFIX}{file.stem}"
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise InputError(f"connector {target!r}: {path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(file.parent.resolve()))
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001
        sys.modules.pop(name, None)
        raise InputError(f"connector {target!r}: cannot import {path}: {type(exc).__name__}: {exc}"
                         f"{_compat_hint(exc, compat)}") from None
    finally:
        sys.path.remove(str(file.parent.resolve()))
    return module
