"""`trtllm-v2`: KVCacheManagerV2 as TensorRT-LLM's `main` runs a connector (#18762 and later).

Read at NVIDIA/TensorRT-LLM@10b8fbd9: `connectors/kv_cache_connector.py` (`query_num_new_matched_tokens`,
`commit_new_matched_tokens`), `kv_cache/kv_cache_manager_v2.py` (`_run_kv_connector_hooks`,
`_apply_connector_matched_prefix`, `_reserve_connector_prefix`, `free_resources`), `py_executor.py`
(`_reject_non_gpu_cache_tiers`), `tests/unittest/_torch/executor/test_kv_connector_v2_prefix.py`;
prefix reservations at brb-nv/TensorRT-LLM@64ecf956 (the reservation manager) and
NVIDIA/TensorRT-LLM@785b0128 (`connectors/prefix_load_completion.py`).

Without reservations (the "legacy final-batch" path, `FinalBatchAdmission`):
- scheduling allocates a first chunk at the local match and asks nothing;
- once the batch is final (`prepare_resources`), each first chunk of an allocation not reported
  yet is asked (a side-effect-free query), the offer clamped to `prompt_len - 1`; an offer inside
  the chunk moves its start, one reaching past it shifts the chunk (its size kept, a non-final
  end floored to a block) and grows the allocation; a grow that fails falls back to the whole
  blocks the chunk's pages hold; only what was honoured is committed (the rest is recomputed and
  never handed back: there is no `cancel_load`, the connector lets it go at `request_finished`);
- an asynchronous answer parks the request even when nothing was honoured;
- once per allocation: a paused request (its allocation destroyed) is asked again, reported new.

With a connector that implements all of `reserve_prefix`, `release_prefix_reservation` and
`get_finished_prefix_loads` (prefix-aware scheduling, on by default), `ReservingAdmission`:
`reserve_prefix` during scheduling with a fresh id per attempt, the promise clamped and floored to
a block (the rest released), a rejected candidate released whole, accepted loads authorised by
`SchedulerOutput.prefix_loads` and retired only when every worker reported them
(`prefix_reservations`). A partial implementation is refused at bring-up.

Also refused with a connector: cache tiers below GPU, speculative decoding.
"""

from __future__ import annotations

from kvtool.connector.api import RESERVATION_HOOKS, PrefixLoad, reservation_hooks, takes_part_in_reservations
from kvtool.connector.runtime import HookResult, PastThePrompt
from kvtool.engine.batch import Batch, TokenBudget
from kvtool.engine.events import Ask, NotHonoured, Reserve
from kvtool.engine.request_state import FailureReason, Offer, Phase, RequestState
from kvtool.engine.runtimes.admission import AdmissionHost, Admits, ConnectorAdmission
from kvtool.engine.runtimes.prefix_reservations import Reservation, ReservationBook
from kvtool.engine.runtimes.profile import BringUp, Registration, RuntimeName, RuntimeProfile
from kvtool.engine.runtimes.refusals import first, gpu_tier_only, no_speculative_decoding


class FinalBatchAdmission(ConnectorAdmission):
    def first_chunk(self, state: RequestState, budget: TokenBudget, admits: Admits) -> int:
        kv = self.create_cache(state)
        local_end = kv.num_committed_tokens
        kv.resume()
        n = self.chunk(local_end, state.prompt_len, budget)
        # kvtool's choice: the connector's answer comes after this allocation, and pages it may load
        # into must be real (not SWA scratch slots), so a request the connector may serve gets none.
        if not n or not kv.resize(local_end + n, scratch_reuse=not self.asks(state)) or not admits(state):
            return self.defer(state)
        state.admit(kv, local_end, local_end)
        return n

    def final_batch(self, batch: Batch, iteration: int) -> None:
        chunks = dict((id(s), n) for s, n in batch.context)
        for state in list(batch.first_chunks):
            reported, state.allocation_reported = state.allocation_reported, True
            if self.connector is None or reported:
                continue
            if self.asks(state) and not self._serve(state, chunks[id(state)], batch, iteration):
                continue
            if not self.tell_pages(state, batch):
                continue
            if state.offer is not None and state.offer.is_async:
                self.park(state, batch, iteration)

    def _serve(self, state: RequestState, n: int, batch: Batch, iteration: int) -> bool:
        """Ask, serve what the allocation can hold, commit what was honoured; False: the request failed."""
        local_end, prompt_len = state.position, state.prompt_len
        answer = self.query(state, local_end, clamp_to=prompt_len - 1)
        if answer is None:
            batch.drop(state)
            return False
        if not answer.num_tokens:
            return True
        offered_end = max(min(local_end + answer.num_tokens, prompt_len - 1), local_end)
        position, chunk_end = self._served(state, local_end, offered_end, local_end + n)
        state.offer = Offer(local_end, position, answer.is_async)
        if position > local_end:
            state.serve_from(position)
            batch.rechunk(state, chunk_end - position)
        self.record_delivery(state, local_end, position, iteration)
        if local_end + answer.num_tokens > position:
            self.host.emit(NotHonoured, request_id=state.request_id, start=position, end=local_end + answer.num_tokens)
        return True

    def _served(self, state: RequestState, local_end: int, offered_end: int, chunk_end: int) -> tuple[int, int]:
        """(where the chunk now starts, where it ends) once the offer [local_end, offered_end) is served
        as far as the allocation can grow to hold it."""
        kv, tpb, prompt_len = self.cache(state), self.manager.tokens_per_block, state.prompt_len
        if offered_end <= local_end:
            return local_end, chunk_end
        if offered_end < chunk_end:   # inside the chunk: the chunk starts later
            kv.resize(kv.capacity, offered_end, scratch_reuse=False)
            return offered_end, chunk_end
        end = min(offered_end + (chunk_end - local_end), prompt_len)
        floored = end // tpb * tpb
        end = floored if end < prompt_len and floored > offered_end else end
        grew = kv.resize(max(kv.capacity, end), offered_end, scratch_reuse=False)
        self.host.emit(Reserve, request_id=state.request_id, start=local_end, end=offered_end, ok=grew)
        if grew:
            return offered_end, end
        capped = (chunk_end - 1) // tpb * tpb   # the whole blocks this chunk's pages hold, a token left
        if capped > local_end:
            kv.resize(kv.capacity, capped, scratch_reuse=False)
            return capped, chunk_end
        return local_end, chunk_end


class ReservingAdmission(ConnectorAdmission):
    """`main`'s V2 with prefix reservations (the connector implements the three hooks)."""

    uses_prefix_loads = True

    def __init__(self, host: AdmissionHost) -> None:
        super().__init__(host)
        self.book = ReservationBook(self.hooks, host.emit)
        self._candidates: dict[int, Reservation] = {}
        self._awaited: dict[int, int] = {}
        """Request id -> the reservation whose asynchronous load it waits for (in TRANSMISSION): only
        that one's retirement resumes it, never a stale one of an earlier attempt."""

    def first_chunk(self, state: RequestState, budget: TokenBudget, admits: Admits) -> int:
        kv = self.create_cache(state)
        local_end = kv.num_committed_tokens
        kv.resume()
        candidate = self._reserve(state, local_end) if self.asks(state) else None
        if state.phase is Phase.FAILED:
            return 0
        if candidate is not None and not kv.resize(max(kv.capacity, candidate.end), candidate.end,
                                                   scratch_reuse=False):
            self.book.release_unaccepted(candidate)
            candidate = None
        position = candidate.end if candidate is not None else local_end
        n = self.chunk(position, state.prompt_len, budget)
        if not n or not kv.resize(position + n, scratch_reuse=not self.asks(state)) or not admits(state):
            if candidate is not None:   # the candidate is rejected: released whole, a retry asks anew
                self.book.release_unaccepted(candidate)
            return self.defer(state)
        state.admit(kv, position, local_end)
        if candidate is not None:
            self._candidates[state.request_id] = candidate
        return n

    def _reserve(self, state: RequestState, local_end: int) -> Reservation | None:
        """The attempt's promise, clamped to `prompt_len - 1` and floored to a block (the rest
        released); None without one (or when the request failed)."""
        rid = self.book.next_id()
        state.asked = True
        answer = self.hooks.reserve(state.request, local_end, rid)
        if answer is None:
            self.host.fail(state, FailureReason.ASK_RAISED, f"reserve_prefix raised {self.hooks.failures[-1].error}")
            return None
        if answer.refusal is not None:
            self.refuse(state, answer.refusal)
            return None
        tpb = self.manager.tokens_per_block
        end = min(local_end + answer.num_tokens, state.prompt_len - 1) // tpb * tpb
        self.host.emit(Ask, request_id=state.request_id, num_computed_tokens=local_end,
                       num_offered_tokens=max(end - local_end, 0), is_async=answer.is_async)
        if not answer.num_tokens:
            return None
        reservation = self.book.open(rid, state.request, local_end, answer.num_tokens, answer.is_async)
        if end <= local_end:
            self.book.release_unaccepted(reservation)
            return None
        self.book.release(reservation, end, reservation.end)
        reservation.end = end
        return reservation

    def final_batch(self, batch: Batch, iteration: int) -> None:
        for state in list(batch.first_chunks):
            state.allocation_reported = True
            if self.connector is None:
                continue
            candidate = self._candidates.pop(state.request_id, None)
            if candidate is not None:
                self.book.accept(candidate, self.cache(state).page_indices_by_group(),
                                 list(state.prompt_tokens), state.request.cache_salt, iteration)
                state.offer = Offer(candidate.start, candidate.end, candidate.is_async)
                self.record_delivery(state, candidate.start, candidate.end, iteration)
            if not self.tell_pages(state, batch):
                continue
            if candidate is not None and candidate.is_async:
                self.park(state, batch, iteration, reported_by_get_finished=False)
                self._awaited[state.request_id] = candidate.reservation_id

    def take_prefix_loads(self) -> list[PrefixLoad]:
        return self.book.take_loads()

    def retire_reported(self, answers: dict[int, HookResult]) -> tuple[list[int], bool]:
        """Retire the loads every rank reported; the requests waiting for exactly those resume."""
        done, ok = self.hooks.collect_prefix_loads(self.book.tracked, answers, ignored=self.book.given_up)
        resumed = []
        for rid in done:
            request_id = self.book.retire(rid).request.request_id
            if self._awaited.get(request_id) == rid:
                del self._awaited[request_id]
                resumed.append(request_id)
        return resumed, ok

    def unretired_since(self) -> list[tuple[int, float]]:
        return self.book.unretired_since()

    def holds_allocation(self, state: RequestState) -> bool:
        """The request waits for its asynchronous prefix load (the runtime never aborts a transfer)."""
        return state.phase is Phase.TRANSMISSION and state.request_id in self._awaited

    def request_failed(self, state: RequestState) -> None:
        """The request failed (not as a cancellation waiting for its load: `holds_allocation`): a
        candidate not accepted, a load not dispatched, and one dispatched that has not retired (its
        pass failed, or it outran the transmission bound) are released, the last given up on."""
        super().request_failed(state)
        self._awaited.pop(state.request_id, None)
        candidate = self._candidates.pop(state.request_id, None)
        if candidate is not None:
            self.book.release_unaccepted(candidate)
        self.book.withdraw(state.request_id)
        self.book.give_up(state.request_id)


class TrtllmV2(RuntimeProfile):
    name = RuntimeName.TRTLLM_V2
    summary = ("main's V2: asked on the final batch (once per allocation, again after a replay), no "
               "cancel_load; prefix reservations for connectors that implement them")
    follows = ("TensorRT-LLM #18762: connectors/kv_cache_connector.py, kv_cache/kv_cache_manager_v2.py "
               "_run_kv_connector_hooks @10b8fbd9; prefix reservations @brb-nv 64ecf956, "
               "connectors/prefix_load_completion.py @785b0128")
    registration = Registration.LAYOUT
    refuses_zero_async = True
    past_the_prompt = PastThePrompt.CLAMP

    def refusal(self, bring_up: BringUp) -> str | None:
        return first(gpu_tier_only(bring_up), no_speculative_decoding(bring_up))

    def connector_refusal(self, bring_up: BringUp) -> str | None:
        implemented = reservation_hooks(bring_up.scheduler_class, bring_up.worker_class)
        if not implemented or takes_part_in_reservations(bring_up.scheduler_class, bring_up.worker_class):
            return None
        missing = [name for name in RESERVATION_HOOKS if name not in implemented]
        return ("prefix reservations require reserve_prefix and release_prefix_reservation on the scheduler and "
                f"get_finished_prefix_loads on every worker: the connector implements {', '.join(implemented)} "
                f"but not {', '.join(missing)}")

    def admission(self, host: AdmissionHost) -> ConnectorAdmission:
        if host.connector is not None and host.prefix_reservations:
            return ReservingAdmission(host)
        return FinalBatchAdmission(host)
