"""`--compat trtllm`: the modules a connector written against TensorRT-LLM imports, provided
inside kvtool's processes when TensorRT-LLM itself is not installed.

They map onto kvtool's own classes (same names, same semantics): the connector ABCs at both the
current (`connectors/`) and the earlier module path, the layout types, `LlmRequest`,
`TorchLlmArgs` / `KvCacheConfig` / `KvCacheConnectorConfig`, `mpi_rank()` (the rank whose hook is
running), `BAD_PAGE_INDEX`. Names that only start a real engine exist and raise a clear error if
called.
"""

from __future__ import annotations

import enum
import importlib.util
import logging
import sys
import types

from kvtool.connector import api, llm_args, rank_context, request
from kvtool.errors import InputError
from kvtool.manager import layout
from kvtool.types import BAD_PAGE_INDEX


class _EngineOnly:
    """A name a connector module imports only to start a real engine."""

    def __init__(self, *args, **kwargs) -> None:
        raise RuntimeError(f"{type(self).__name__} starts a TensorRT-LLM engine, which kvtool does not; "
                           "the connector classes are driven by kvtool's runtime instead")


class LLM(_EngineOnly):
    pass


class SamplingParams(_EngineOnly):
    pass


class ExecutorConfig(_EngineOnly):
    pass


class DisaggregatedParams(_EngineOnly):
    pass


def _logger() -> logging.Logger:
    log = logging.getLogger("tensorrt_llm")
    log.set_level = lambda level: log.setLevel(str(level).upper())  # type: ignore[attr-defined]
    return log


def _module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    module.__dict__["__kvtool_compat__"] = True
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


class LlmRequestState(enum.Enum):
    """The request states a connector may compare against (kvtool's requests do not carry one)."""

    CONTEXT_INIT = 2
    GENERATION_IN_PROGRESS = 3
    GENERATION_COMPLETE = 5
    DISAGG_GENERATION_INIT = 8
    DISAGG_CONTEXT_TRANS_IN_PROGRESS = 10
    DISAGG_GENERATION_TRANS_IN_PROGRESS = 12


def _world_size() -> int:
    return rank_context.world_size()


def get_draft_token_length(request) -> int:
    """Draft tokens of the request's next step (kvtool's requests carry none yet)."""
    return len(getattr(request, "py_draft_tokens", None) or ())


_CONNECTOR = dict(KvCacheConnectorScheduler=api.KvCacheConnectorScheduler,
                  KvCacheConnectorWorker=api.KvCacheConnectorWorker, SchedulerOutput=api.SchedulerOutput,
                  RequestData=api.RequestData)
_LAYOUT = dict(KvCacheRegion=layout.KvCacheRegion, KvCacheLayout=layout.KvCacheLayout,
               KvCacheLayerGroupLayout=layout.KvCacheLayerGroupLayout, valid_page_slots=api.valid_page_slots,
               BAD_PAGE_INDEX=BAD_PAGE_INDEX)


def install() -> bool:
    """Provide the shim modules; False (and nothing changed) when TensorRT-LLM is importable."""
    if "tensorrt_llm" in sys.modules or importlib.util.find_spec("tensorrt_llm") is not None:
        return False
    _install_click_stub()
    ranks = dict(mpi_rank=rank_context.current_rank, global_mpi_rank=rank_context.current_rank,
                 local_mpi_rank=rank_context.current_rank, mpi_world_size=_world_size)
    _module("tensorrt_llm", LLM=LLM, SamplingParams=SamplingParams, DisaggregatedParams=DisaggregatedParams,
            logger=_logger(), __version__="kvtool-compat", mpi_rank=rank_context.current_rank)
    _module("tensorrt_llm._utils", **ranks)
    _module("tensorrt_llm.mapping", Mapping=llm_args.Mapping)
    _module("tensorrt_llm._torch")
    _module("tensorrt_llm._torch.pyexecutor")
    _module("tensorrt_llm._torch.pyexecutor.kv_cache_connector", **_CONNECTOR)   # the path before connectors/
    _module("tensorrt_llm._torch.pyexecutor.connectors")
    _module("tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector", **_CONNECTOR)
    _module("tensorrt_llm._torch.pyexecutor.connectors.kv_cache_layout", **_LAYOUT)
    _module("tensorrt_llm._torch.pyexecutor.llm_request", LlmRequest=request.Request, LlmRequestState=LlmRequestState,
            get_draft_token_length=get_draft_token_length)
    _module("tensorrt_llm.runtime")
    _module("tensorrt_llm.runtime.kv_cache_manager_v2", BAD_PAGE_INDEX=BAD_PAGE_INDEX)
    _module("tensorrt_llm.bindings", LlmRequestState=LlmRequestState)
    _module("tensorrt_llm.bindings.executor", ExecutorConfig=ExecutorConfig)
    _module("tensorrt_llm.bindings.internal")
    _module("tensorrt_llm.bindings.internal.batch_manager", LlmRequest=request.Request,
            LlmRequestState=LlmRequestState)
    _module("tensorrt_llm.llmapi", LLM=LLM, SamplingParams=SamplingParams, KvCacheConfig=llm_args.KvCacheConfig)
    _module("tensorrt_llm.llmapi.llm_args", KvCacheConnectorConfig=llm_args.KvCacheConnectorConfig,
            TorchLlmArgs=llm_args.LlmArgs, KvCacheConfig=llm_args.KvCacheConfig)
    return True


COMPAT = {"trtllm": install}


def install_compat(name: str | None, also: tuple[str, ...] = ()) -> None:
    """Provide the modules of `--compat NAME` (nothing for None); InputError for an unknown name,
    naming the known ones and `also` (the names the command handles itself, e.g. vllm)."""
    if name is None:
        return
    if name not in COMPAT:
        raise InputError(f"unknown --compat {name!r}; known: {', '.join([*COMPAT, *also])}")
    COMPAT[name]()
