"""Building `SchedulerOutput`: each scheduled request as the connector sees it, as append-deltas."""

from __future__ import annotations

from kvtool.connector.api import RequestData, SchedulerOutput
from kvtool.engine.request_state import RequestState
from kvtool.engine.scheduler import Batch


def build_scheduler_output(batch: Batch, iteration: int) -> SchedulerOutput:
    """New requests the first time they are reported (everything), cached ones after (deltas);
    a request whose allocation was destroyed (`RequestState.forget_reported`) is new again, whole.

    Requests loading asynchronously are not in the batch, and dummy requests never are.
    """
    output = SchedulerOutput()
    for state, n in batch.context:
        data = _request_data(state, computed=state.position, scheduled=n, iteration=iteration)
        (output.new_requests if data[1] else output.cached_requests).append(data[0])
    for state in batch.generation:   # TensorRT-LLM: 1 + get_draft_token_length(request)
        tokens = state.request.get_num_tokens()
        output.cached_requests.append(_request_data(state, computed=tokens - 1, scheduled=1 + state.num_drafts,
                                                    iteration=iteration)[0])
    return output


def _request_data(state: RequestState, computed: int, scheduled: int, iteration: int) -> tuple[RequestData, bool]:
    is_new = state.reported_tokens < 0
    tokens = state.request._token_view()
    pages = state.kv.page_indices_by_group()
    start_tokens = 0 if is_new else state.reported_tokens
    by_group = pages if is_new else pages.since(state.reported_blocks)
    if is_new and state.delivered_at == iteration:
        computed -= state.num_external   # the local match: what the connector loads comes on top
    state.reported_tokens = len(tokens)
    state.reported_blocks = pages.lengths()
    request = state.request
    data = RequestData(request_id=state.request_id, new_tokens=tokens[start_tokens:],
                       new_block_ids=by_group.flat(), computed_position=computed,
                       num_scheduled_tokens=scheduled, cache_salt=request.cache_salt,
                       new_block_ids_by_layer_group=by_group.as_lists(), cache_salt_id=request.cache_salt_id)
    return data, is_new

