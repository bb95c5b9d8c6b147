"""The command line's door to `--compat vllm`: importing this module imports no vLLM; running
through it requires vLLM (exit 2 with the install line where it is missing)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtool.errors import InputError
from kvtool.validate.results import CheckResult
from kvtool.vllm_compat.install import require_vllm
from kvtool.vllm_compat.target import ConnectorTarget, parse_target

if TYPE_CHECKING:
    from kvtool.bench.protocol_engine import Workload
    from kvtool.bench.protocol_suite import ProtocolRow
    from kvtool.connector.loader import ConnectorSpec
    from kvtool.connector.request import Request
    from kvtool.vllm_compat.trace_replay import VllmTraceShape

VLLM_COMPAT = "vllm"
VLLM_DEFAULT_MODELS = ["tiny", "tiny-vswa"]


def run_vllm_validation(target: str, options: Mapping[str, str], models: list[str], block_size: int, seed: int,
                        names: list[str], timeout: float,
                        on_result: Callable[[list[CheckResult]], None]) -> list[CheckResult]:
    """Validate the vLLM connector `target` (see `target.parse_target`) on `models`."""
    require_vllm()
    from kvtool.vllm_compat.validation import validate_vllm

    return validate_vllm(known_target(target, options), models, block_size, seed, names, timeout, on_result)


def run_vllm_store(target: str, options: Mapping[str, str], model: str, tokens_per_block: list[int],
                   workload: Workload, repeats: int, rounds: int, reference: tuple[ConnectorSpec, dict[str, str]]
                   ) -> tuple[list[ProtocolRow], list[str]]:
    """`bench --suite store --compat vllm`: the vLLM connector `target` beside `reference`
    (`store_bench.run_vllm_store_suite`); VllmMissing or InputError (exit 2) before anything runs."""
    require_vllm()
    from kvtool.vllm_compat.store_bench import run_vllm_store_suite

    return run_vllm_store_suite(known_target(target, options), model, tokens_per_block, workload, repeats, rounds,
                                reference)


def run_vllm_trace(target: str, options: Mapping[str, str], requests: Iterable[Request], model: str,
                   shape: VllmTraceShape) -> dict[str, Any]:
    """`trace run --compat vllm`: the workload through the vLLM connector `target`
    (`trace_replay.replay_vllm`, in a temporary folder); VllmMissing or InputError (exit 2) first."""
    require_vllm()
    import tempfile

    from kvtool.vllm_compat.trace_replay import replay_vllm

    checked = known_target(target, options)
    with tempfile.TemporaryDirectory(prefix="kvtool-vllm-trace-") as folder:
        return replay_vllm(requests, checked, model, shape, Path(folder))


def known_target(text: str, options: Mapping[str, str]) -> ConnectorTarget:
    """The target, checked against vLLM's connector factory: InputError (exit 2) for a name it
    does not register, or a module path whose class cannot be loaded."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    target = parse_target(text, options)
    if target.module_path is None and target.name not in KVConnectorFactory._registry:
        known = ", ".join(sorted(KVConnectorFactory._registry))
        raise InputError(f"--compat vllm: vLLM's connector factory registers no {target.name!r}; known: {known}; "
                         "or give MODULE:CLASS, FILE.py:CLASS or kvtool-host")
    if target.module_path is not None:
        import importlib

        try:
            getattr(importlib.import_module(target.module_path), target.name)
        except (ImportError, AttributeError) as exc:
            raise InputError(f"--compat vllm: cannot load {target.label}: {exc}") from None
    return target
