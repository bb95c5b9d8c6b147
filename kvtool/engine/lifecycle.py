"""How a request's life ends or pauses: every transition that calls the connector
(`request_finished` on a finish, a failure or a pause; `get_finished`'s reports acted on) and the
one table of pages held for asynchronous saves in flight.

A request whose `request_finished` answered True (it saves asynchronously) keeps its pages until
every rank reported the save: the finished one in SAVING, a failed or paused one whatever its phase.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvtool.connector.runtime import ConnectorRuntime
from kvtool.engine.engine_config import EngineStats
from kvtool.engine.events import Finished, LoadFinished, Paused, SaveFinished, SaveStarted
from kvtool.engine.request_queues import RequestQueues
from kvtool.engine.request_state import FailureReason, Phase, RequestState
from kvtool.group_pages import GroupPages
from kvtool.manager.kv_cache import KvCache
from kvtool.manager.manager import KvCacheManager, PageHold
from kvtool.types import KvCacheStatus

if TYPE_CHECKING:
    from kvtool.engine.runtimes.admission import ConnectorAdmission


class SaveHolds:
    """Pages kept alive for asynchronous saves in flight, by request id. Invariant: each hold is
    released once, when every rank reported the request's save, or at once when a request that
    was saving fails (its save is given up on)."""

    def __init__(self, manager: KvCacheManager) -> None:
        self._manager = manager
        self._holds: dict[int, list[PageHold]] = {}

    def keep(self, request_id: int, kv: KvCache) -> None:
        """Hold `kv`'s pages (before it closes) until `release(request_id)`."""
        self._holds.setdefault(request_id, []).append(self._manager.hold_pages(kv))

    def release(self, request_id: int) -> None:
        for hold in self._holds.pop(request_id, ()):
            hold.release()

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._holds

    def __len__(self) -> int:
        """Requests whose pages wait for a report (the engine waits for the connector meanwhile)."""
        return len(self._holds)


class Lifecycle:
    """The ends of requests: finished, failed, paused, saved, loaded. `connector` None: a run
    without one (nothing to tell, nothing saved asynchronously). Every request that ends here
    leaves `queues`, is counted in `stats` and is forgotten by every rank's fake engine (the ids
    gathered by `take_forgotten` for the iteration's `FinishedOrder`)."""

    def __init__(self, connector: ConnectorRuntime | None, manager: KvCacheManager, queues: RequestQueues,
                 stats: EngineStats, emit: Callable[..., None], admission: ConnectorAdmission) -> None:
        self.connector = connector
        self._manager = manager
        self._queues = queues
        self._stats = stats
        self._emit = emit
        self._admission = admission
        """The runtime profile's half that hands back an undelivered offer and says whether an
        allocation must outlive a cancellation (a prefix load in flight)."""
        self.holds = SaveHolds(manager)
        self._forgotten: list[int] = []

    # ---- transitions that tell the connector ---------------------------------------------------
    def finish(self, state: RequestState) -> None:
        """The request generated its last token: `request_finished` with its pages; an
        asynchronous save keeps them (SAVING) until every rank reports it."""
        is_async = False
        if self.connector is not None and state.seen_by_connector:
            ok, is_async = self.connector.finish(state.request, state.held_kv.page_indices_by_group())
            if not ok:
                self.close(state, Phase.FAILED, FailureReason.FINISHED_HOOK_RAISED)
                return
        self._emit_finished(state, None)
        if is_async:
            state.start_saving()
            self.holds.keep(state.request_id, state.held_kv)
            state.held_kv.close()
            self._emit(SaveStarted, request_id=state.request_id)
        else:
            self.close(state, Phase.DONE)

    def fail(self, state: RequestState, reason: FailureReason, detail: str = "") -> None:
        """Fail one request cleanly: hand back an undelivered offer, let the connector forget it,
        release its pages (after its save, when it saves asynchronously). Other requests are
        untouched. `state.error` reads "<reason>: <detail>"."""
        if not state.is_live:
            return
        if reason is FailureReason.ABORTED and self._admission.holds_allocation(state):
            state.pending_failure = (reason, detail)   # ended when its load retires (`prefix_load_done`)
            return
        if self.connector is not None:
            self._admission.request_failed(state)
            if (state.seen_by_connector or state.asked) and state.phase is not Phase.SAVING:
                kv = state.kv if state.kv is not None and state.kv.status is not KvCacheStatus.CLOSED else None
                pages = kv.page_indices_by_group() if kv is not None else \
                    GroupPages([] for _ in self._manager.layer_groups)
                ok, is_async = self.connector.finish(state.request, pages)
                if ok and is_async and kv is not None:   # its save reads these pages: keep them until it lands
                    self.holds.keep(state.request_id, kv)
        self.close(state, Phase.FAILED, reason, detail)

    def pause(self, state: RequestState, iteration: int) -> None:
        """TensorRT-LLM's destructive pause (see `Engine.pause`): `request_finished` (an
        asynchronous save keeps the pages until reported), the allocation released, the request
        back in the waiting queue."""
        kv, request_id = state.held_kv, state.request_id
        num_computed = kv.history_length
        if self.connector is not None and state.seen_by_connector:
            ok, is_async = self.connector.finish(state.request, kv.page_indices_by_group())
            if not ok:
                self.fail(state, FailureReason.FINISHED_HOOK_RAISED)
                return
            if is_async:
                self.holds.keep(request_id, kv)
        kv.close()
        state.pause(num_computed)
        state.paused_at = iteration
        self.forget(request_id)
        self._queues.requeue(state)
        self._stats.num_pauses += 1
        self._emit(Paused, request_id=request_id, num_computed_tokens=num_computed, context_len=state.prompt_len)

    def fail_pass(self, states: list[RequestState], reason: str) -> None:
        """A worker hook raised: the pass's requests fail (those already finished and saving keep
        their pages until the save is reported)."""
        for state in states:
            if state.is_live and state.phase is not Phase.SAVING:
                self.fail(state, FailureReason.CONNECTOR_FAILED_IN_PASS, reason)

    # ---- get_finished's reports ----------------------------------------------------------------
    def loaded(self, request_id: int) -> None:
        """Every rank reported the request's asynchronous load: it runs again."""
        state = self._queues.states.get(request_id)
        if state is not None and state.phase is Phase.TRANSMISSION:
            state.load_landed()
            self._emit(LoadFinished, request_id=state.request_id)

    def prefix_load_done(self, request_id: int) -> None:
        """Every rank reported the request's prefix load: an asynchronous one runs again, or, if it
        was cancelled meanwhile, ends now (its allocation was kept for the load)."""
        state = self._queues.states.get(request_id)
        if state is None or state.phase is not Phase.TRANSMISSION:
            return
        if state.pending_failure is not None:
            reason, detail = state.pending_failure
            state.pending_failure = None
            self.fail(state, reason, detail)
            return
        state.load_landed()
        self._emit(LoadFinished, request_id=state.request_id)

    def saved(self, request_id: int) -> None:
        """Every rank reported the request's asynchronous save: its pages go, and a finished
        request is DONE."""
        state = self._queues.states.get(request_id)
        finished = state is not None and state.phase is Phase.SAVING
        if finished and state is not None:   # (finished: it is)
            state.end(Phase.DONE)
        self.holds.release(request_id)
        if finished and state is not None:
            self._emit(SaveFinished, request_id=request_id)
            self._drop(state)

    # ---- endings -------------------------------------------------------------------------------
    def close(self, state: RequestState, phase: Phase, failure: FailureReason | None = None,
              detail: str = "") -> None:
        """End a request in `phase`; a FAILED one records `failure` and "<reason>: <detail>" as its error."""
        was_saving = state.phase is Phase.SAVING
        if failure is not None and not was_saving:
            self._emit_finished(state, failure)
        reason = None if failure is None else f"{failure.value}: {detail}" if detail else failure.value
        if state.kv is not None:
            state.kv.close()
        state.end(phase, failure, reason)
        if was_saving:
            self.holds.release(state.request_id)
        self.forget(state.request_id)
        if phase is Phase.FAILED:
            self._stats.num_failed += 1
            self._stats.failures.append(f"request {state.request_id}: {reason}")
        self._drop(state)

    def forget(self, request_id: int) -> None:
        """Every rank's fake engine drops what it keeps for the request (`take_forgotten`)."""
        self._forgotten.append(request_id)

    def take_forgotten(self) -> list[int]:
        """The requests to forget since the last call, for the iteration's `FinishedOrder`."""
        forgotten, self._forgotten = self._forgotten, []
        return forgotten

    def _drop(self, state: RequestState) -> None:
        if state.is_live:
            return
        self._stats.num_finished += 1
        self._queues.remove(state)

    def _emit_finished(self, state: RequestState, failure: FailureReason | None) -> None:
        self._emit(Finished, request_id=state.request_id, failure=failure,
                   num_generated_tokens=state.request.num_generated_tokens,
                   prompt_len=state.request.original_prompt_len, num_local_hit=state.num_local_hit,
                   num_external=state.num_external, arrival=state.request.arrival)
