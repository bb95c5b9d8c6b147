"""What `kvtool validate --compat vllm TARGET` names: a vLLM connector, as `KVTransferConfig` takes it.

TARGET is one of
- a name in vLLM's connector factory (`ExampleConnector`, `OffloadingConnector`, `MultiConnector`, ...);
- `package.module:ClassName`, an out-of-tree connector (`kv_connector_module_path`);
- `path/to/file.py:ClassName`, a connector in a file (imported as a module of its own);
- `kvtool-host`, kvtool's reference vLLM connector (`kvtool.vllm_compat.host_connector`).

`--connector-opt KEY=VALUE` become `kv_connector_extra_config` (a VALUE that parses as JSON is
taken as JSON). A string value may say `{folder}`: the scenario's own temporary folder, so that a
store on disk starts empty in every scenario.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtool.errors import InputError

BUILT_IN = {"kvtool-host": ("kvtool.vllm_compat.host_connector", "KvtoolHostConnector")}
"""kvtool's own vLLM connectors, by the name a command gives."""

DEFAULT_EXTRA: dict[str, dict[str, Any]] = {
    "ExampleConnector": {"shared_storage_path": "{folder}/example-store"},
    "OffloadingConnector": {"cpu_bytes_to_use": 1 << 26},
    "SimpleCPUOffloadConnector": {"cpu_bytes_to_use": 1 << 26},
}
"""What kvtool passes a connector unless told otherwise: a store folder inside the scenario's own
(ExampleConnector's default is /tmp), the CPU tier size an offloading connector requires."""


@dataclass(frozen=True)
class ConnectorTarget:
    """A connector as `KVTransferConfig` names it."""

    name: str
    """`kv_connector`: a factory name, or the class name of an out-of-tree connector."""
    module_path: str | None = None
    """`kv_connector_module_path` for an out-of-tree connector."""
    extra: tuple[tuple[str, Any], ...] = ()
    """`kv_connector_extra_config`, `{folder}` not yet substituted."""
    label: str = ""
    """What the command said."""

    def in_folder(self, folder: Path) -> ConnectorTarget:
        """This target with `{folder}` in its options replaced by `folder`."""
        return ConnectorTarget(self.name, self.module_path, tuple((k, _substitute(v, folder)) for k, v in self.extra),
                               self.label)

    @property
    def extra_config(self) -> dict[str, Any]:
        return dict(self.extra)


def parse_target(text: str, options: Mapping[str, str]) -> ConnectorTarget:
    """The connector `text` names with `options` as its extra config; InputError when a file or
    module form names nothing importable."""
    extra = {**DEFAULT_EXTRA.get(text, {}), **{k: _value(v) for k, v in options.items()}}
    items = tuple(sorted(extra.items()))
    if text in BUILT_IN:
        module, cls = BUILT_IN[text]
        return ConnectorTarget(cls, module, items, text)
    where, sep, cls = text.rpartition(":")
    if not sep:
        return ConnectorTarget(text, None, items, text)
    if not where or not cls.isidentifier():
        raise InputError(f"--compat vllm: {text!r} is not NAME, MODULE:CLASS or FILE.py:CLASS")
    if where.endswith(".py"):
        return ConnectorTarget(cls, _module_of_file(Path(where)), items, text)
    if importlib.util.find_spec(where.split(".")[0]) is None:
        raise InputError(f"--compat vllm: no module {where!r} to import {cls} from")
    return ConnectorTarget(cls, where, items, text)


def _module_of_file(path: Path) -> str:
    """Import the file as a module of its own (vLLM's factory imports a module path) and name it."""
    if not path.is_file():
        raise InputError(f"--compat vllm: no connector file {path}")
    name = "kvtool_vllm_target_" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path.resolve())
        if spec is None or spec.loader is None:
            raise InputError(f"--compat vllm: cannot import {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return name


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _substitute(value: Any, folder: Path) -> Any:
    if isinstance(value, str):
        return value.replace("{folder}", str(folder))
    if isinstance(value, list):
        return [_substitute(v, folder) for v in value]
    if isinstance(value, dict):
        return {k: _substitute(v, folder) for k, v in value.items()}
    return value
