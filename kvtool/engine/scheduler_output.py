"""Building `SchedulerOutput`: each scheduled request as the connector sees it, as append-deltas."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from kvtool.connector.api import PrefixLoad, RequestData, SchedulerOutput
from kvtool.engine.batch import Batch
from kvtool.engine.request_state import RequestState
from kvtool.engine.runtimes.profile import RuntimeProfile


def build_scheduler_output(batch: Batch, iteration: int, profile: RuntimeProfile,
                           prefix_loads: Sequence[PrefixLoad] = ()) -> SchedulerOutput:
    """New requests the first time they are reported (everything), cached ones after (deltas);
    a request whose allocation was destroyed (`RequestState.forget_reported`) is new again, whole.
    `profile` adds what its runtime reports besides (V1: block hashes, priorities, flat ids only).

    Requests loading asynchronously are not in the batch, and dummy requests never are; the prefix
    loads confirmed this iteration go in `prefix_loads`.
    """
    output = SchedulerOutput(prefix_loads=list(prefix_loads))
    for state, n in batch.context:
        data, is_new = _request_data(state, computed=state.position, scheduled=n, iteration=iteration)
        profile.annotate(data, state, is_new)
        (output.new_requests if is_new else output.cached_requests).append(data)
    for state in batch.generation:   # TensorRT-LLM: 1 + get_draft_token_length(request)
        tokens = state.request.get_num_tokens()
        data, _ = _request_data(state, computed=tokens - 1, scheduled=1 + state.num_drafts, iteration=iteration)
        profile.annotate(data, state, False)
        output.cached_requests.append(data)
    return output


def _request_data(state: RequestState, computed: int, scheduled: int, iteration: int) -> tuple[RequestData, bool]:
    is_new = state.reported_tokens < 0
    tokens = state.tokens
    pages = state.held_kv.page_indices_by_group()
    start_tokens = 0 if is_new else state.reported_tokens
    by_group = pages if is_new else pages.since(state.reported_blocks)
    if is_new and state.delivered_at == iteration:
        computed -= state.num_external   # the local match: what the connector loads comes on top
    state.reported_tokens = len(tokens)
    state.reported_blocks = pages.lengths()
    request = state.request
    # new_tokens: a compact prompt's slice is an array until RequestData.__post_init__ makes it a list
    data = RequestData(request_id=state.request_id, new_tokens=cast("list[int]", tokens[start_tokens:]),
                       new_block_ids=by_group.flat(), computed_position=computed,
                       num_scheduled_tokens=scheduled, cache_salt=request.cache_salt,
                       new_block_ids_by_layer_group=by_group.as_lists(), cache_salt_id=request.cache_salt_id)
    return data, is_new

