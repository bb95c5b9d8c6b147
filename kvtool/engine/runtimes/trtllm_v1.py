"""`trtllm-v1`: TensorRT-LLM's V1 KV cache manager, as a connector sees it.

Read at NVIDIA/TensorRT-LLM: `connectors/kv_cache_connector.py` @035ab91c (`get_num_new_matched_tokens`
querying and committing in one step, `build_scheduler_output`'s V1 branch, `block_hashes`,
`priorities`), `pyexecutor/resource_manager.py` `KVCacheManager.prepare_resources` (the stored copy
with `add_sequence_batch`), `cpp/.../kvCacheManager.cpp` `WindowBlockManager::addSequence` and
`llmRequest.h` `setPrepopulatedPromptLen`, `py_executor.py` `_maybe_init_kv_connector_manager`.

- The capacity scheduler admits a request only when its whole prompt fits (GUARANTEED_NO_EVICT,
  the only policy V1 runs a connector under), so the connector is never asked about a request
  that is then deferred.
- At the first context chunk, while the sequence is added, the connector is asked with the local
  reuse length and its answer taken whole, at once: V1 allocates the whole prompt in the same call
  and never honours less than it was offered. An offer that leaves no prompt token to compute is
  refused (`prepopulatedPromptLen >= promptLen`), as is `(0, True)`. There is no `cancel_load`.
- `update_state_after_alloc(request, block_ids)` gets every block of the prompt (flat, pool-wide
  ids); later chunks report `new_block_ids == []`; decode adds a block at each block boundary.
- The first chunk starts at the local match plus the connector's tokens and keeps the size the
  scheduler charged; when the prompt goes on past it, its end is floored to a block boundary.
- `register_kv_caches` gets the one primary pool tensor `[num_blocks, num_layers, kv_factor,
  block_size]`; `register_kv_cache_layout` is never called.
- `RequestData.block_hashes`: the request's chain of full-block hashes so far, on every report;
  `priorities`: one per new block where the request has a retention config, else None.
"""

from __future__ import annotations

from kvtool.connector.api import RequestData, implements
from kvtool.connector.runtime import PastThePrompt
from kvtool.engine.batch import Batch, TokenBudget
from kvtool.engine.request_state import Offer, RequestState
from kvtool.engine.runtimes.admission import AdmissionHost, Admits, ConnectorAdmission
from kvtool.engine.runtimes.block_hashes import extend_block_hashes
from kvtool.engine.runtimes.profile import BringUp, CapacityPolicy, Registration, RuntimeName, RuntimeProfile
from kvtool.engine.runtimes.refusals import first, guaranteed_no_evict, no_host_offloading, single_window


class V1Admission(ConnectorAdmission):
    def first_chunk(self, state: RequestState, budget: TokenBudget, admits: Admits) -> int:
        kv = self.create_cache(state)
        local_end = kv.num_committed_tokens
        kv.resume()
        prompt_len = state.prompt_len
        if not kv.resize(prompt_len, local_end) or not admits(state):
            return self.defer(state)
        position = self._ask(state, local_end) if self.asks(state) and not state.asked else local_end
        if position is None:
            return 0
        if position > local_end:
            kv.resize(prompt_len, position, scratch_reuse=False)
        charged = self.chunk(0, prompt_len, budget)
        n = self._first_chunk_tokens(position, charged, prompt_len)
        budget.take(charged - n)   # the scheduler charged the chunk before the connector's answer
        state.admit(kv, position, local_end)
        return n

    def _ask(self, state: RequestState, local_end: int) -> int | None:
        """The position the first chunk starts at: the local match plus what the connector offered
        (taken whole); None when the request failed (the hook raised, or the answer was refused)."""
        answer = self.query(state, local_end, clamp_to=state.prompt_len)
        if answer is None:
            return None
        end = local_end + answer.num_tokens
        if answer.num_tokens and end >= state.prompt_len:
            self.refuse(state, f"offered {answer.num_tokens} tokens past {local_end}, the whole "
                               f"{state.prompt_len}-token prompt: TensorRT-LLM's V1 takes an offer whole and "
                               "needs a prompt token left to compute (prepopulatedPromptLen >= promptLen); the "
                               "V2 runtimes cut the offer at the last position instead")
            return None
        if answer.num_tokens:
            state.offer = Offer(local_end, end, answer.is_async)
        return end

    def _first_chunk_tokens(self, position: int, charged: int, prompt_len: int) -> int:
        """V1's `setPrepopulatedPromptLen`: the chunk the scheduler sized from position 0 starts at
        `position`; when the prompt goes on past it, its end is floored to a block boundary."""
        if position == 0:   # nothing prepopulated: the chunk stays as sized
            return charged
        if position + charged >= prompt_len:
            return prompt_len - position
        tpb = self.manager.tokens_per_block
        floored = (position + charged) // tpb * tpb
        return floored - position if floored > position else charged

    def context_capacity(self, state: RequestState, end: int) -> int:
        """The whole prompt's pages were allocated at the first chunk: a later chunk allocates nothing."""
        return max(end, self.cache(state).capacity)

    def final_batch(self, batch: Batch, iteration: int) -> None:
        for state in list(batch.first_chunks):
            offer = state.offer
            if offer is not None and not offer.closed:
                self.record_delivery(state, offer.start, offer.end, iteration)
            if self.connector is None or not self.tell_pages(state, batch):
                continue
            if state.num_external and self.offer(state).is_async:
                self.park(state, batch, iteration)


class TrtllmV1(RuntimeProfile):
    name = RuntimeName.TRTLLM_V1
    summary = ("the V1 manager (the default for most models): asked while the sequence is added, the whole "
               "prompt's pages at once, one pool tensor, block hashes")
    follows = ("TensorRT-LLM connectors/kv_cache_connector.py @035ab91c (V1 branch); resource_manager.py "
               "KVCacheManager.prepare_resources; kvCacheManager.cpp addSequence; llmRequest.h "
               "setPrepopulatedPromptLen; py_executor.py _maybe_init_kv_connector_manager")
    registration = Registration.POOL_TENSOR
    flat_hooks = True
    refuses_zero_async = True
    past_the_prompt = PastThePrompt.REFUSE
    use_kv_cache_manager_v2 = False
    capacity_policies = frozenset({CapacityPolicy.GUARANTEED_NO_EVICT})
    default_capacity_policy = CapacityPolicy.GUARANTEED_NO_EVICT

    def cannot_host(self, scheduler_class: type, worker_class: type) -> str | None:
        """A worker without `register_kv_caches`, or a scheduler with only the per-layer-group
        page hooks, was written for V2: V1 calls neither form it has."""
        if not implements(worker_class, "register_kv_caches"):
            return (f"{worker_class.__name__} implements register_kv_cache_layout only: TensorRT-LLM's V1 hands a "
                    "worker its one pool tensor through register_kv_caches")
        flat = [name for name in ("update_state_after_alloc", "request_finished")
                if not implements(scheduler_class, name)]
        if flat:
            return (f"{scheduler_class.__name__} implements only the per-layer-group form of {' and '.join(flat)}: "
                    "TensorRT-LLM's V1 calls the flat form, with pool-wide block ids")
        return None

    def refusal(self, bring_up: BringUp) -> str | None:
        return first(no_host_offloading(bring_up), single_window(bring_up), guaranteed_no_evict(bring_up))

    def admission(self, host: AdmissionHost) -> ConnectorAdmission:
        return V1Admission(host)

    def annotate(self, data: RequestData, state: RequestState, is_new: bool) -> None:
        """Flat ids only, the request's block-hash chain so far, and a priority per new block
        when it has a retention config."""
        data.new_block_ids_by_layer_group = []
        request = state.request
        kv = ConnectorAdmission.cache(state)
        tpb = kv.tokens_per_block
        data.block_hashes = list(extend_block_hashes(state.block_hashes, state.tokens, tpb, request.cache_salt))
        retention = request.kv_cache_retention_config
        if retention is not None:
            first_new = len(kv.get_page_indices(0)) - len(data.new_block_ids)
            data.priorities = [retention.priority_of_block(first_new + j, tpb, request.original_prompt_len)
                               for j in range(len(data.new_block_ids))]
