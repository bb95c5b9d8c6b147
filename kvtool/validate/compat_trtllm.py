"""`--compat trtllm`: the modules a connector written against TensorRT-LLM imports, provided
inside the validate process when TensorRT-LLM itself is not installed.

They map onto kvtool's own classes (same names, same semantics); names that only start a real
engine exist and raise a clear error if called.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import types

from kvtool.connector import api, llm_args, request
from kvtool.manager import layout


class _EngineOnly:
    """A name a connector module imports only to start a real engine."""

    def __init__(self, *args, **kwargs) -> None:
        raise RuntimeError(f"{type(self).__name__} starts a TensorRT-LLM engine, which kvtool validate does not; "
                           "the connector classes are driven by kvtool's runtime instead")


class LLM(_EngineOnly):
    pass


class SamplingParams(_EngineOnly):
    pass


class ExecutorConfig(_EngineOnly):
    pass


def _logger() -> logging.Logger:
    log = logging.getLogger("tensorrt_llm")
    log.set_level = lambda level: log.setLevel(str(level).upper())  # type: ignore[attr-defined]
    return log


def _module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    module.__kvtool_compat__ = True
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, module)
    return module


def _passthrough_decorator(*args, **kwargs):
    """`@click.command(...)`, `@click.option(...)`: the decorated function, unchanged."""
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda function: function


def _install_click_stub() -> None:
    """TensorRT-LLM's example connectors import click for their own `main()` (which starts an engine,
    so validate never calls it); typer no longer brings click, so give them decorators that do
    nothing, unless the real click is installed."""
    if "click" in sys.modules or importlib.util.find_spec("click") is not None:
        return
    _module("click", command=_passthrough_decorator, option=_passthrough_decorator,
            argument=_passthrough_decorator, group=_passthrough_decorator, Path=lambda *a, **k: str,
            Choice=lambda *a, **k: str, echo=print)


def install() -> bool:
    """Provide the shim modules; False (and nothing changed) when TensorRT-LLM is importable."""
    if "tensorrt_llm" in sys.modules or importlib.util.find_spec("tensorrt_llm") is not None:
        return False
    _install_click_stub()
    connector = dict(KvCacheConnectorScheduler=api.KvCacheConnectorScheduler,
                     KvCacheConnectorWorker=api.KvCacheConnectorWorker, SchedulerOutput=api.SchedulerOutput,
                     RequestData=api.RequestData)
    _module("tensorrt_llm", LLM=LLM, SamplingParams=SamplingParams, logger=_logger(), __version__="kvtool-compat")
    _module("tensorrt_llm._torch")
    _module("tensorrt_llm._torch.pyexecutor")
    _module("tensorrt_llm._torch.pyexecutor.kv_cache_connector", **connector)
    _module("tensorrt_llm._torch.pyexecutor.connectors")
    _module("tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector", **connector)
    _module("tensorrt_llm._torch.pyexecutor.connectors.kv_cache_layout", KvCacheRegion=layout.KvCacheRegion,
            KvCacheLayout=layout.KvCacheLayout, valid_page_slots=api.valid_page_slots)
    _module("tensorrt_llm.bindings")
    _module("tensorrt_llm.bindings.executor", ExecutorConfig=ExecutorConfig)
    _module("tensorrt_llm.bindings.internal")
    _module("tensorrt_llm.bindings.internal.batch_manager", LlmRequest=request.Request)
    _module("tensorrt_llm.llmapi", LLM=LLM)
    _module("tensorrt_llm.llmapi.llm_args", KvCacheConnectorConfig=llm_args.KvCacheConnectorConfig,
            TorchLlmArgs=llm_args.LlmArgs, KvCacheConfig=llm_args.KvCacheConfig)
    return True


COMPAT = {"trtllm": install}
