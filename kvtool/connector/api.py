"""The KV cache connector API. Names and call order are kept from the reference runtime, so a
connector written for it ports with an import change.

Scheduler side (`KvCacheConnectorScheduler`, one instance, on the leader) and worker side
(`KvCacheConnectorWorker`, one per rank). Both are constructed with one runtime-arguments object
(`llm_args`, kept as `self._llm_args`; `llm_args.kv_cache_config.tokens_per_block` at least).

Page lists: a page index is a slot id scoped to its layer group. Per-group lists hold one entry
per block ordinal, so entry `i` always describes tokens `[i * tpb, (i + 1) * tpb)`; an entry equal
to `BAD_PAGE_INDEX` (-1) means the block has no page in that group (a sliding-window block the
window has passed, or one that will be stale when the prompt ends) and must be neither read nor
written. Never index a tensor with it: -1 is the last slot in Python.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from kvtool.errors import LayoutNotSupportedError
from kvtool.group_pages import valid_page_slots as valid_page_slots  # re-exported: the API names it

STORE_NAMESPACE_ENV = "KVTOOL_STORE_NAMESPACE"
"""A connector whose store outlives the process on a shared server (not in the working folder)
scopes its keys by this environment variable's value when it is set. `kvtool validate` sets a fresh
one for every scenario and sub-run, so each starts with a cold store."""

if TYPE_CHECKING:
    import torch

    from kvtool.connector.llm_args import LlmArgs
    from kvtool.connector.options import ConnectorOption
    from kvtool.connector.request import Request
    from kvtool.manager.layout import KvCacheLayout


@dataclass
class RequestData:
    """One scheduled request, as `build_connector_meta` sees it (TensorRT-LLM's fields, in its order).

    - `new_tokens`, `new_block_ids`, `new_block_ids_by_layer_group`: what was added since this
      request was last reported (everything, the first time): successive reports are append-deltas.
      A request whose allocation was destroyed and that runs again is reported as new, whole.
    - `new_block_ids_by_layer_group`: `List[List[int]]`, position = layer group id, each list
      positionally aligned (BAD_PAGE_INDEX in place). With one layer group `new_block_ids` is that
      group's list; with several it is `[]`, because a page index is scoped to its group.
    - `computed_position`: tokens already in the cache before this pass. A first report in the
      iteration of a synchronous load excludes the tokens the connector loads in it (it is the local
      match); a request loading asynchronously is absent from the output while it loads, and its
      first report, after the load, includes the loaded tokens (docs/connector-guide.md, D3 and D4).
    - `num_scheduled_tokens`: tokens the coming pass computes (1 for a decode step).
    - `block_hashes`: `[]` and `priorities`: None, as on TensorRT-LLM's V2 manager (not reported).
    - `cache_salt`: the request's salt (None without one); a connector mixes it into its keys.
    - `cache_salt_id`: the integer id older TensorRT-LLM versions carried instead (None without a salt).
    """

    request_id: int
    new_tokens: list[int]
    new_block_ids: list[int]
    computed_position: int
    num_scheduled_tokens: int
    block_hashes: list[int] = field(default_factory=list)
    priorities: list[int] | None = None
    cache_salt: str | None = None
    new_block_ids_by_layer_group: list[list[int]] = field(default_factory=list)
    cache_salt_id: int | None = None

    def __post_init__(self) -> None:
        if type(self.new_tokens) is not list:   # a compact prompt's slice: connectors get a list
            self.new_tokens = list(self.new_tokens)


@dataclass(frozen=True)
class PrefixReservation:
    """A promise `reserve_prefix` made: tokens [start, end) of the request's prompt, kept loadable
    by the connector under `reservation_id` (fresh for every attempt) until released."""

    reservation_id: int
    request_id: int
    start: int
    end: int
    is_async: bool


@dataclass(frozen=True)
class PrefixLoad(PrefixReservation):
    """A confirmed load of a reservation (`SchedulerOutput.prefix_loads`): load [start, end) into
    these pages. `block_ids_by_layer_group` covers the request's blocks from ordinal 0 (position =
    layer group id, BAD_PAGE_INDEX in place); `tokens` are the prompt's."""

    block_ids_by_layer_group: list[list[int]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    cache_salt: str | None = None


@dataclass
class SchedulerOutput:
    """`new_requests` holds each request the first time it is scheduled (and again, whole, after
    its allocation was destroyed), `cached_requests` after. `attention_dp_rank` is None: kvtool
    runs tensor-parallel ranks, never attention data parallelism."""


    new_requests: list[RequestData] = field(default_factory=list)
    cached_requests: list[RequestData] = field(default_factory=list)
    attention_dp_rank: int | None = None
    prefix_loads: list[PrefixLoad] = field(default_factory=list)
    """The loads of prefix reservations confirmed in this iteration (`main`'s V2 with a connector
    that implements reservations): authoritative, also for a request absent from the lists above
    (it left the batch to load asynchronously). Empty on every other runtime."""


RESERVATION_HOOKS = ("reserve_prefix", "release_prefix_reservation", "get_finished_prefix_loads")
"""The three hooks a connector implements to take part in prefix reservations: all, or none."""


def takes_part_in_reservations(scheduler_class: type, worker_class: type) -> bool:
    """Whether the connector implements all three reservation hooks."""
    return len(reservation_hooks(scheduler_class, worker_class)) == len(RESERVATION_HOOKS)


def reservation_hooks(scheduler_class: type, worker_class: type) -> tuple[str, ...]:
    """Which of `RESERVATION_HOOKS` the connector's classes implement (override)."""
    owners = (scheduler_class, scheduler_class, worker_class)
    bases = (KvCacheConnectorScheduler, KvCacheConnectorScheduler, KvCacheConnectorWorker)
    return tuple(name for name, owner, base in zip(RESERVATION_HOOKS, owners, bases, strict=True)
                 if getattr(owner, name, None) is not getattr(base, name))


def _stand_in(flat: str, grouped: str) -> Callable[..., Any]:
    """What a flat hook becomes in a class that implements only its per-layer-group form."""
    def stand_in(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} implements {grouped}, not {flat}: "
                                  f"call {grouped} (the runtime always does)")
    stand_in.__name__ = stand_in.__qualname__ = flat
    stand_in.__kvtool_stand_in__ = True  # type: ignore[attr-defined]
    return stand_in


def implements(cls: type, name: str) -> bool:
    """Whether `cls` has a method `name` of its own making: not abstract, not the stand-in a
    flat hook becomes in a class that implements only its per-layer-group form."""
    method = getattr(cls, name, None)
    return method is not None and not getattr(method, "__isabstractmethod__", False) \
        and not getattr(method, "__kvtool_stand_in__", False)


def _satisfy_flat_forms(cls: type, base: type, grouped_of: dict[str, str]) -> None:
    """A subclass overriding the grouped form of a still-abstract flat hook needs no flat stub:
    the flat one becomes a stand-in that raises NotImplementedError naming the grouped one. A class
    implementing neither keeps the flat hook abstract, so constructing it raises TypeError naming it."""
    for flat, grouped in grouped_of.items():
        overrides_grouped = getattr(cls, grouped, None) is not getattr(base, grouped, None)
        if overrides_grouped and getattr(getattr(cls, flat, None), "__isabstractmethod__", False):
            setattr(cls, flat, _stand_in(flat, grouped))


def _only_group(pages_by_group: list[list[int]], cls: type, flat: str, grouped: str) -> list[int]:
    """The one group's list for a flat-only connector; NotImplementedError with several groups."""
    if len(pages_by_group) != 1:
        raise NotImplementedError(f"{cls.__name__} implements only {flat}, but this KV cache has "
                                  f"{len(pages_by_group)} layer groups: implement {grouped}")
    return list(pages_by_group[0])


class KvCacheConnectorScheduler(ABC):
    """Scheduler side. Obligations of the runtime towards it:

    - `get_num_new_matched_tokens` is asked **once per request** (also across deferral), never
      for generation-only or dummy requests, while the request's cache is suspended.
    - Every offered token is, in the end, either delivered (loaded into the request's pages) or
      handed back with `cancel_load(request, start, end)`; never both, never neither.
    - `update_state_after_alloc_by_layer_group` receives the pages of the first chunk once they are
      allocated; later chunks arrive as append-deltas through `build_connector_meta`.
    - `build_connector_meta` runs once per iteration that schedules a request; its result reaches
      every worker.
    - `request_finished` runs once per request that finishes (or fails after the connector saw
      it), before that iteration's `get_finished`. `request_reset` runs instead when an allocation
      the connector saw is released and the request will run again from the start.

    The per-layer-group forms are what the runtime calls (with an empty list, for a request with
    no KV cache, it calls the flat form). A connector implements either form of each; the flat
    form alone serves a cache of one layer group only.

    Obligations of the connector: answer `(num_tokens >= 0, is_async)` with `num_tokens` no larger
    than the prompt past `num_computed_tokens`, never `(0, True)`; hold nothing for a request once
    its tokens were cancelled or it finished.
    """

    supports_attention_dp: bool = False
    """TensorRT-LLM's opt-in for attention data parallelism (kvtool never runs it)."""
    kvtool_options: ClassVar[tuple[ConnectorOption, ...]]
    """Optional: the options this connector reads (kvtool.connector.options); declared, not set here."""

    def __init__(self, llm_args: LlmArgs) -> None:
        self._llm_args = llm_args

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _satisfy_flat_forms(cls, KvCacheConnectorScheduler,
                            {"update_state_after_alloc": "update_state_after_alloc_by_layer_group",
                             "request_finished": "request_finished_by_layer_group"})

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """How many tokens past the local match (`num_computed_tokens`) the connector can provide,
        and whether it loads them asynchronously. The runtime may use fewer: it hands the rest back
        through `cancel_load` (e.g. it always computes the last prompt position itself)."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int]) -> None:
        """The pages that now back the request, for a cache of one layer group."""

    def update_state_after_alloc_by_layer_group(self, request: Request,
                                                block_ids_by_layer_group: list[list[int]]) -> None:
        """Per-group form (position = layer group id). Default: the flat form, with one group only."""
        self.update_state_after_alloc(request, _only_group(block_ids_by_layer_group, type(self),
                                                           "update_state_after_alloc",
                                                           "update_state_after_alloc_by_layer_group"))

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        """Once per iteration that schedules a request: the metadata every worker receives."""

    @abstractmethod
    def request_finished(self, request: Request, cache_block_ids: list[int]) -> bool:
        """The request finished (cache of one layer group). True: the connector saves
        asynchronously and the runtime keeps the pages alive until every worker reports the
        request in `get_finished`."""

    def request_finished_by_layer_group(self, request: Request,
                                        cache_block_ids_by_layer_group: list[list[int]]) -> bool:
        """Per-group form (position = layer group id). Default: the flat form, with one group only."""
        return self.request_finished(request, _only_group(cache_block_ids_by_layer_group, type(self),
                                                          "request_finished", "request_finished_by_layer_group"))

    def cancel_load(self, request: Request, start: int, end: int) -> None:
        """The runtime will not use offered tokens `[start, end)` (absolute prompt positions):
        the tail cut by the last-position clamp, a head the local cache overtook, an offer whose
        pages could not be reserved, or a request freed before delivery. Default: nothing."""

    def request_reset(self, request: Request) -> None:
        """The request's allocation was released and it will run again from the start: drop what
        was keyed by its page indices (they may now belong to another request). Its replay is
        reported in `new_requests` with its whole block list. Default: nothing."""

    def wait_for_initialization(self) -> None:
        """Called once, after every worker registered its KV cache. Default: nothing."""

    def reserve_prefix(self, request: Request, num_computed_tokens: int, reservation_id: int) -> tuple[int, bool]:
        """Prefix reservations (`main`'s V2): promise tokens [num_computed_tokens, + count) under
        `reservation_id`, answered `(count, is_async)`: keep their source loadable and start no
        transfer (loads start only from `SchedulerOutput.prefix_loads`). The runtime may release
        all or part of the promise (`release_prefix_reservation`). Not implemented by default."""
        raise NotImplementedError(f"{type(self).__name__} does not implement reserve_prefix")

    def release_prefix_reservation(self, request: Request, reservation_id: int, start: int, end: int) -> None:
        """Tokens [start, end) of reservation `reservation_id` are released: unused, or loaded on
        every worker. Each token of a promise is released exactly once. Not implemented by default."""
        raise NotImplementedError(f"{type(self).__name__} does not implement release_prefix_reservation")


class HostStream:
    """What the worker hooks get as `stream` where the KV pages are in host memory (a CPU run): the
    calls a connector makes on a CUDA stream, as no-ops, since work on the CPU is done when the call
    returns. Where the pages are on a GPU, the hooks get a `torch.cuda.Stream` instead."""

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event

    def query(self) -> bool:
        return True


class KvCacheConnectorWorker(ABC):
    """Worker side, one per rank. In an iteration that schedules requests the runtime calls
    `start_load_kv`; when the batch still holds requests once those loading asynchronously left
    it, the forward pass runs: per layer `wait_for_layer_load` (before the layer reads its KV) and
    `save_kv_layer` (after it wrote), then `wait_for_save` (after which the pages may be reused).
    `get_finished` is called at the end of every iteration, after `request_finished` of the
    requests that ended in it.

    The metadata built for the pass is `self._metadata`. Loads for a pass must have landed when
    `wait_for_layer_load` returns for that layer (synchronous loads) or before the worker reports
    the request in `get_finished` (asynchronous loads).

    `stream`, in every hook that takes one, is never None: with the KV pages on a GPU it is the
    forward pass's `torch.cuda.Stream` (the engine's current stream); with the pages in host memory
    (a CPU run) it is a `HostStream`, whose `synchronize`, `wait_stream`, `wait_event`,
    `record_event` and `query` do nothing. A connector that must tell them apart tests
    `isinstance(stream, torch.cuda.Stream)`.
    """

    supports_attention_dp: bool = False
    """TensorRT-LLM's opt-in for attention data parallelism (kvtool never runs it)."""

    def __init__(self, llm_args: LlmArgs) -> None:
        self._llm_args = llm_args
        self._metadata: Any = None

    def bind_connector_meta(self, metadata: Any) -> None:
        self._metadata = metadata

    def get_connector_meta(self) -> Any:
        return self._metadata

    def _clear_connector_meta(self) -> None:
        self._metadata = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _satisfy_flat_forms(cls, KvCacheConnectorWorker, {"register_kv_caches": "register_kv_cache_layout"})

    def register_kv_cache_layout(self, layout: KvCacheLayout) -> None:
        """Receive the KV cache layout (regions per layer group). Default: a cache that is one
        pool tensor (one layer group, one whole-slot region) goes to `register_kv_caches`; any
        other raises LayoutNotSupportedError (a NotImplementedError) naming this method."""
        tensor = layout.as_single_pool_tensor()
        if tensor is None:
            raise LayoutNotSupportedError(
                f"{type(self).__name__} does not implement register_kv_cache_layout, and this KV cache is "
                f"not one pool tensor ({layout.num_layer_groups} layer group(s), "
                f"{sum(len(g.regions) for g in layout.groups)} region(s)): implement "
                "register_kv_cache_layout(layout) and address pages through layout.groups[g].regions")
        self.register_kv_caches(tensor)

    @abstractmethod
    def register_kv_caches(self, kv_cache_tensor: torch.Tensor) -> None:
        """Single-tensor registration: TensorRT-LLM's primary pool `[num_slots, num_layers, roles,
        tokens_per_block * heads * head_dim]`, reached through `register_kv_cache_layout`'s default
        for a one-pool cache."""

    def register_forward_pass_callable(self) -> Callable[[], None] | None:
        """Optionally a callable the runtime runs at the end of every forward pass (after the last
        layer's `save_kv_layer`, before `wait_for_save`), with the forward stream current: the place
        to record a CUDA event that says when the pass's KV is written. Asked once, at setup."""
        return None

    @abstractmethod
    def start_load_kv(self, stream: torch.cuda.Stream | HostStream) -> None:
        """Begin the loads the metadata asks for."""

    @abstractmethod
    def wait_for_layer_load(self, layer_idx: int, stream: torch.cuda.Stream | HostStream) -> None:
        """Return once layer `layer_idx`'s loads for this pass have landed."""

    @abstractmethod
    def save_kv_layer(self, layer_idx: int, stream: torch.cuda.Stream | HostStream) -> None:
        """Layer `layer_idx` was written: a layer-by-layer save may start."""

    @abstractmethod
    def wait_for_save(self, stream: torch.cuda.Stream | HostStream) -> None:
        """Return once the synchronous saves of this pass no longer need the pages."""

    def get_finished_prefix_loads(self) -> list[int]:
        """Prefix reservations (`main`'s V2): the ids of confirmed prefix loads whose writes
        finished on this worker since the last call, synchronous ones too; never waits for other
        workers. Default: none."""
        return []

    @abstractmethod
    def get_finished(self, finished_gen_req_ids: list[int],
                     started_loading_req_ids: list[int]) -> tuple[list[int], list[int]]:
        """(ids whose asynchronous save finished, ids whose asynchronous load finished). An id may
        only be returned after it was passed in, and once. The runtime acts on an id only when
        every rank has reported it."""
