"""`trtllm-v2-release`: KVCacheManagerV2 as TensorRT-LLM's release branches run a connector
(#18700, a cherry-pick of #17974; read at NVIDIA/TensorRT-LLM@64cec6be, the integration test of
that shape, and the connector docs' `cancel_load` section).

Allocation happens during scheduling, and a prepared request can still be dropped, so the
connector interaction follows the manager's own seam, in three phases:

1. Ask (cache still suspended): once per allocation, memoising the absolute offer end. The offer
   is clamped to `prompt_len - 1` (the first generation step needs the last prompt position's
   activations) and the dropped tail is cancelled.
2. Reserve (after `resume`, since resize needs ACTIVE): when the offer reaches past the local
   match, SWA scratch reuse goes off and capacity and history move together to the offer end. On
   failure the offer is cancelled and the request computes locally.
3. Deliver (on the final batch, before the forward pass): the head the local match overtook is
   cancelled, the rest recorded as external tokens, the connector told which pages back the request.

A request whose first chunk cannot get pages is deferred: its cache is closed and it is prepared
again next iteration (its local match may have grown); the connector is not asked again.
"""

from __future__ import annotations

from kvtool.engine.batch import Batch, TokenBudget
from kvtool.engine.events import Reserve
from kvtool.engine.request_state import Offer, Phase, RequestState
from kvtool.engine.runtimes.admission import AdmissionHost, Admits, ConnectorAdmission
from kvtool.engine.runtimes.profile import BringUp, Registration, RuntimeName, RuntimeProfile
from kvtool.engine.runtimes.refusals import gpu_tier_only


class ReleaseV2Admission(ConnectorAdmission):
    def first_chunk(self, state: RequestState, budget: TokenBudget, admits: Admits) -> int:
        kv = self.create_cache(state)
        local_end = kv.num_committed_tokens
        if not state.asked and not self._ask(state, local_end):
            return 0
        kv.resume()
        position = self._reserve(state, local_end)
        if state.phase is Phase.FAILED:
            return 0
        n = self.chunk(position, state.prompt_len, budget)
        if not n or not kv.resize(position + n) or not admits(state):
            return self.defer(state)
        state.admit(kv, position, local_end)
        return n

    def _ask(self, state: RequestState, local_end: int) -> bool:
        """Ask once; memoise the absolute, clamped offer. False: the request failed."""
        state.asked = True
        if not self.asks(state):
            return True
        answer = self.query(state, local_end, clamp_to=state.prompt_len - 1)
        if answer is None:
            return False
        if answer.num_tokens == 0:
            return True
        end = local_end + answer.num_tokens
        clamped = min(end, state.prompt_len - 1)
        state.offer = Offer(local_end, clamped, answer.is_async)
        if end > clamped:
            self.cancel(state, clamped, end)
        if clamped <= local_end:
            state.offer.closed = True
        return True

    def _reserve(self, state: RequestState, local_end: int) -> int:
        offer, kv = state.offer, self.cache(state)
        if offer is None or offer.closed or offer.end <= local_end:
            return local_end
        ok = kv.resize(max(kv.capacity, offer.end), offer.end, scratch_reuse=False)
        self.host.emit(Reserve, request_id=state.request_id, start=offer.start, end=offer.end, ok=ok)
        if ok:
            return offer.end
        offer.closed = True
        self.cancel(state, offer.start, offer.end)
        return local_end

    def final_batch(self, batch: Batch, iteration: int) -> None:
        for state in list(batch.first_chunks):
            self._deliver(state, batch, iteration)

    def _deliver(self, state: RequestState, batch: Batch, iteration: int) -> None:
        offer = state.offer
        if offer is not None and not offer.closed:
            committed = min(self.cache(state).num_committed_tokens, offer.end)
            self.cancel(state, offer.start, committed)
            self.record_delivery(state, committed, offer.end, iteration)
        if self.connector is None:
            return
        if not self.tell_pages(state, batch):
            return
        if state.num_external and self.offer(state).is_async:
            self.park(state, batch, iteration)

    def hand_back(self, state: RequestState, start: int, end: int) -> None:
        self.cancel(state, start, end)


class ReleaseV2(RuntimeProfile):
    name = RuntimeName.TRTLLM_V2_RELEASE
    summary = "release V2: asked during scheduling, deferral after the ask, cancel_load for unused offers"
    follows = ("TensorRT-LLM #18700 (cherry-pick of #17974): pyexecutor/resource_manager.py KVCacheManagerV2 "
               "phases 1-3; tests/integration/defs/llmapi/test_llm_api_connector.py at 64cec6be")
    registration = Registration.LAYOUT
    calls_cancel_load = True

    def refusal(self, bring_up: BringUp) -> str | None:
        return gpu_tier_only(bring_up)

    def admission(self, host: AdmissionHost) -> ConnectorAdmission:
        return ReleaseV2Admission(host)
