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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from kvtool.errors import ConnectorError
from kvtool.group_pages import GroupPages, valid_page_slots as valid_page_slots  # re-exported: the API names it

STORE_NAMESPACE_ENV = "KVTOOL_STORE_NAMESPACE"
"""A connector whose store outlives the process on a shared server (not in the working folder)
scopes its keys by this environment variable's value when it is set. `kvtool validate` sets a fresh
one for every scenario and sub-run, so each starts with a cold store."""

if TYPE_CHECKING:
    import torch

    from kvtool.connector.llm_args import LlmArgs
    from kvtool.connector.request import Request
    from kvtool.manager.layout import KvCacheLayout


@dataclass
class RequestData:
    """One scheduled request, as `build_connector_meta` sees it.

    - `new_tokens`, `new_block_ids`, `new_block_ids_by_layer_group`: what was added since this
      request was last reported (everything, the first time): successive reports are append-deltas.
    - `new_block_ids_by_layer_group`: group id -> page list, positionally aligned (BAD_PAGE_INDEX in
      place). With one layer group `new_block_ids` is that group's list; with several it is `[]`,
      because a page index is scoped to its group and there is no correct flattening.
    - `computed_position`: tokens already in the cache before this pass. For a request reported for
      the first time it excludes the tokens the connector will load (it is the local match).
    - `num_scheduled_tokens`: tokens the coming pass computes.
    - `block_hashes`, `priorities`: empty means not reported.
    """

    request_id: int
    new_tokens: list[int]
    new_block_ids: list[int]
    computed_position: int
    num_scheduled_tokens: int
    new_block_ids_by_layer_group: GroupPages = field(default_factory=GroupPages)
    block_hashes: list[bytes] = field(default_factory=list)
    priorities: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """`new_requests` holds each request the first time it is scheduled, `cached_requests` after."""

    new_requests: list[RequestData] = field(default_factory=list)
    cached_requests: list[RequestData] = field(default_factory=list)


class KvCacheConnectorScheduler(ABC):
    """Scheduler side. Obligations of the runtime towards it:

    - `get_num_new_matched_tokens` is asked **exactly once per request** (also across deferral),
      never for generation-only or dummy requests, while the request's cache is suspended.
    - Every offered token is, in the end, either delivered (loaded into the request's pages) or
      handed back with `cancel_load(request, start, end)`; never both, never neither.
    - `update_state_after_alloc` receives the pages of the first chunk once they are allocated;
      later chunks arrive as append-deltas through `build_connector_meta`.
    - `build_connector_meta` runs once per iteration; its result reaches every worker.
    - `request_finished` runs once per request that finishes (or fails after the connector saw it).

    Obligations of the connector: answer `(num_tokens >= 0, is_async)` with `num_tokens` no larger
    than the prompt past `num_computed_tokens`, never `(0, True)`; hold nothing for a request once
    its tokens were cancelled or it finished.
    """

    def __init__(self, llm_args: LlmArgs) -> None:
        self._llm_args = llm_args

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """How many tokens past the local match (`num_computed_tokens`) the connector can provide,
        and whether it loads them asynchronously. The runtime may use fewer: it hands the rest back
        through `cancel_load` (e.g. it always computes the last prompt position itself)."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int]) -> None:
        """The pages that now back the request (the flat list: `[]` with several layer groups)."""

    def update_state_after_alloc_by_layer_group(self, request: Request,
                                                block_ids_by_layer_group: GroupPages) -> None:
        """Per-group form, always called by the runtime; the default forwards the flat list."""
        self.update_state_after_alloc(request, block_ids_by_layer_group.flat())

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        """Once per iteration: the metadata every worker receives (as `self._metadata`)."""

    @abstractmethod
    def request_finished(self, request: Request, cache_block_ids: list[int]) -> bool:
        """The request finished. True: the connector saves asynchronously and the runtime keeps
        the pages alive until every worker reports the request in `get_finished`."""

    def request_finished_by_layer_group(self, request: Request,
                                        cache_block_ids_by_layer_group: GroupPages) -> bool:
        """Per-group form, always called by the runtime; the default forwards the flat list."""
        return self.request_finished(request, cache_block_ids_by_layer_group.flat())

    def cancel_load(self, request: Request, start: int, end: int) -> None:
        """The runtime will not use offered tokens `[start, end)` (absolute prompt positions):
        the tail cut by the last-position clamp, a head the local cache overtook, an offer whose
        pages could not be reserved, or a request freed before delivery. Default: nothing."""


class KvCacheConnectorWorker(ABC):
    """Worker side, one per rank. The runtime calls, for each pass: `start_load_kv`, then per layer
    `wait_for_layer_load` (before the layer reads its KV) and `save_kv_layer` (after it wrote),
    then `wait_for_save` (after which the pages may be reused), then `get_finished`.

    The metadata built for the pass is `self._metadata`. Loads for a pass must have landed when
    `wait_for_layer_load` returns for that layer (synchronous loads) or before the worker reports
    the request in `get_finished` (asynchronous loads).
    """

    def __init__(self, llm_args: LlmArgs) -> None:
        self._llm_args = llm_args
        self._metadata: Any = None

    def bind_connector_meta(self, metadata: Any) -> None:
        self._metadata = metadata

    def get_connector_meta(self) -> Any:
        return self._metadata

    def _clear_connector_meta(self) -> None:
        self._metadata = None

    def register_kv_cache_layout(self, layout: KvCacheLayout) -> None:
        """Receive the KV cache layout (regions per layer group). Override it: the default raises,
        because a connector that only knows `register_kv_caches(tensor)` cannot address a V2 cache."""
        raise ConnectorError(
            f"{type(self).__name__} does not support the V2 KV cache layout: implement "
            "register_kv_cache_layout(layout) and address pages through layout.group(g).regions")

    def register_kv_caches(self, kv_cache_tensor: torch.Tensor) -> None:
        """Single-tensor registration, only for a layout of one layer group with one whole-slot region."""
        raise ConnectorError(f"{type(self).__name__} implements neither register_kv_cache_layout nor "
                             "register_kv_caches")

    def register_forward_pass_callable(self) -> Callable[[], None] | None:
        """Optionally a callable the runtime runs at the end of every forward pass (after the last
        layer's `save_kv_layer`, before `wait_for_save`), with the forward stream current: the place
        to record a CUDA event that says when the pass's KV is written. Asked once, at setup."""
        return None

    @abstractmethod
    def start_load_kv(self, stream: torch.cuda.Stream | None) -> None:
        """Begin the loads the metadata asks for."""

    @abstractmethod
    def wait_for_layer_load(self, layer_idx: int, stream: torch.cuda.Stream | None) -> None:
        """Return once layer `layer_idx`'s loads for this pass have landed."""

    @abstractmethod
    def save_kv_layer(self, layer_idx: int, stream: torch.cuda.Stream | None) -> None:
        """Layer `layer_idx` was written: a layer-by-layer save may start."""

    @abstractmethod
    def wait_for_save(self, stream: torch.cuda.Stream | None) -> None:
        """Return once the synchronous saves of this pass no longer need the pages."""

    @abstractmethod
    def get_finished(self, finished_gen_req_ids: list[int],
                     started_loading_req_ids: list[int]) -> tuple[list[int], list[int]]:
        """(ids whose asynchronous save finished, ids whose asynchronous load finished). An id may
        only be returned after it was passed in, and once. The runtime acts on an id only when
        every rank has reported it."""
