"""Values from a command line or a run file made into validated configs: the manager's config of a
model and cache size, a connector's KEY=VALUE options checked against what it declares. InputError
(exit 2) for a bad one. The trace library and the commands share them; nothing here prints but a
warning or a note on stderr."""

from __future__ import annotations

import sys
from pathlib import Path

from kvtool.connector.loader import ConnectorSpec
from kvtool.connector.options import check_options, declared_options
from kvtool.errors import InputError
from kvtool.manager import KvCacheManagerConfig
from kvtool.models import ModelSpec, load_model, shard_model
from kvtool.units import parse_size

DEFAULT_GPU_MEMORY = "8GiB"


def manager_config(model: str, tokens_per_block: int, dtype: str | None, gpu_memory: str | None,
                   num_slots: int | None, default_memory: str = DEFAULT_GPU_MEMORY,
                   device: str | None = None, tp: tuple[int, int] = (1, 0)) -> KvCacheManagerConfig:
    """A validated manager config from command-line values (InputError for bad ones); `tp` is
    (tensor-parallel size, rank): the config of that rank's shard."""
    if gpu_memory is not None and num_slots is not None:
        raise InputError("give --gpu-memory or --num-slots, not both")
    memory = None if num_slots is not None else parse_size(default_memory if gpu_memory is None else gpu_memory)
    spec = load_model(model, dtype)
    note_model_origin(spec)
    spec = shard_model(spec, *tp) if tp != (1, 0) else spec
    config = KvCacheManagerConfig(spec, tokens_per_block, num_slots=num_slots, memory_bytes=memory, device=device)
    config.validate()
    return config


def connector_options(spec: ConnectorSpec, pairs: list[str], connector_dir: Path | None = None) -> dict[str, str]:
    """The KEY=VALUE options for `spec`, checked against the options it declares (InputError for an
    unknown one); `connector_dir` is the `dir` option, so only for a connector that has one. For a
    connector that declares no options, a warning line names what is passed unchecked."""
    options = parse_options(pairs)
    declared = declared_options(spec.scheduler_class)
    if connector_dir is not None:
        if declared is not None and "dir" not in {o.name for o in declared}:
            raise InputError(f"--connector-dir is the disk connector's folder; connector {spec.name!r} has no "
                             "dir option")
        options["dir"] = str(connector_dir)
    if declared is None:
        if options:
            warn(f"connector {spec.name!r} declares no options (kvtool_options); passing "
                 f"{', '.join(options)} unchecked")
    else:
        check_options(spec.name, declared, options)
    return options


def note_model_origin(spec: ModelSpec) -> None:
    """Say on stderr which name a model read from a config file got, and from what: `kvtool: model
    'mistral' (the model_type of PATH)`; nothing for a preset, or a file whose path is the name."""
    if spec.origin not in ("preset", spec.name):
        print(f"kvtool: model {spec.name!r} ({spec.origin})", file=sys.stderr)


def warn(message: str) -> None:
    print(f"kvtool: warning: {message}", file=sys.stderr)


def parse_options(pairs: list[str]) -> dict[str, str]:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InputError(f"connector option {pair!r} is not KEY=VALUE")
        options[key] = value
    return options
