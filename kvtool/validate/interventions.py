"""What scenarios do to an engine while it runs (`harness.run`'s `setup` and `on_iteration`): abort a
request, evict the local cache, inject a hook failure and watch the pages it released, note page
lists, disrupt a store after an ask. The only validate code besides `harness` that touches the
engine; what these note mid-run are plain values (ids, slots, page sets) that judges read beside
the run's record."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvtool.engine.engine import Engine
from kvtool.engine.pass_types import PassItem
from kvtool.engine.request_state import Phase
from kvtool.types import BAD_PAGE_INDEX
from kvtool.validate.harness import tokens

SENTINEL_ID = -434343

EngineHook = Callable[[Engine], None]


def abort_deferred(request_id: int) -> EngineHook:
    """An on_iteration hook: abort `request_id` while it waits, asked and holding an open offer
    (freed after the ask, before delivery)."""
    def abort(engine: Engine) -> None:
        state = engine.states.get(request_id)
        if state and state.asked and state.phase is Phase.WAITING and state.offer and not state.offer.closed:
            engine.abort(request_id)
    return abort


def abort_in_transmission(request_id: int) -> EngineHook:
    """An on_iteration hook: abort `request_id` once, while its asynchronous load is in flight."""
    done: list[bool] = []

    def abort(engine: Engine) -> None:
        state = engine.states.get(request_id)
        if not done and state and state.phase is Phase.TRANSMISSION:
            engine.abort(request_id)
            done.append(True)
    return abort


def evict_local_cache_after(wave: float) -> EngineHook:
    """An on_iteration hook: once every request arriving at or before `wave` is gone, evict the
    local cache's reusable pages (once), so later requests find their prefix only in the connector."""
    done: list[bool] = []

    def evict(engine: Engine) -> None:
        early = [s for s in engine.states.values() if s.request.arrival <= wave]
        if not done and early and not any(s.is_live for s in early) and not engine.manager.holds:
            engine.manager.evict_reusable()
            done.append(True)
    return evict


def release_reusable_pages(engine: Engine) -> None:
    """After every iteration: pages no request uses are freed (and poisoned) at once, rather than
    kept for the local cache, so nothing reads them afterwards by luck."""
    engine.manager.evict_reusable()


def note_pages(pages: dict[int, list]) -> EngineHook:
    """An on_iteration hook: each live request's page lists into `pages`, one entry per attempt (pause)."""
    def note(engine: Engine) -> None:
        for rid, state in engine.states.items():
            if state.kv is not None and state.kv.is_active:
                attempts = pages.setdefault(rid, [])
                attempts[state.num_pauses:] = [[set(p) - {BAD_PAGE_INDEX} for p in state.kv.page_indices_by_group()]]
    return note


def every_nth_iteration(n: int, action: Callable[[], None]) -> EngineHook:
    """An on_iteration hook: `action` in every iteration divisible by `n`."""
    def each(engine: Engine) -> None:
        if engine.iteration % n == 0:
            action()
    return each


def after_each_offering_ask(disrupt: Callable[[], None], counts: list[int]) -> EngineHook:
    """Setup that runs `disrupt` right after every ask the connector answers with tokens (the
    store changes between the offer and the load), counting how often."""
    def setup(engine: Engine) -> None:
        assert engine.connector is not None   # the remote scenarios run a connector
        scheduler = engine.connector.scheduler
        ask = scheduler.get_num_new_matched_tokens

        def asked(request, num_computed_tokens):
            answer = ask(request, num_computed_tokens)
            if isinstance(answer, tuple) and answer and answer[0]:
                disrupt()
                counts.append(answer[0])
            return answer
        # this connector instance's hook wrapped on purpose (the disruption goes between its answer and the load)
        scheduler.get_num_new_matched_tokens = asked  # type: ignore[method-assign]
    return setup


@dataclass
class InjectedFailure:
    """hook-raises' intervention: `wait_for_layer_load` raises once (when `fail`; else only where
    it would have is noted) in the pass that loads request 1, else in its first pass. `injected`:
    that iteration; `admitted`: the requests admitted by then (the others came after the failure).
    After that iteration a sentinel holds exactly the slots it released, checked for three more."""

    fail: bool
    injected: list[int] = field(default_factory=list)
    admitted: set[int] = field(default_factory=set)
    _free_before: dict[int, set] = field(default_factory=dict)
    _sentinel: list = field(default_factory=list)
    _engine: Engine | None = None

    def setup(self, engine: Engine) -> None:
        """Observe rank 0's pass driver (the workers of this process)."""
        self._engine = engine
        engine.driver.observe(self)

    def before(self, hook: str, rank: int, args: tuple) -> None:
        """A `HookObserver`'s: raising here fails the hook about to run, as if it had raised."""
        if hook == "wait_for_layer_load" and self._engine is not None:
            self._maybe_fail(self._engine)

    def after(self, hook: str, rank: int) -> None:
        pass

    def _maybe_fail(self, engine: Engine) -> None:
        states = engine.states.values()
        loading = any(s.delivered_at == engine.iteration and s.num_external for s in states)
        warm_runs = engine.states[1].kv is not None and engine.states[1].phase is not Phase.WAITING
        if not self.injected and (loading or warm_runs):
            self.injected.append(engine.iteration)
            self.admitted.update(rid for rid, s in engine.states.items() if s.phase is not Phase.WAITING)
            self._free_before.update((i, set(a.free_slots()))
                                     for i, a in enumerate(engine.manager.page_table.allocators))
            if self.fail:
                raise RuntimeError("kvtool validate: injected failure in wait_for_layer_load")

    def after_iteration(self, engine: Engine) -> None:
        """At the end of the iteration of the failure, hold exactly the slots it released, with known
        fingerprints (the other free slots stay for the requests that go on); check them after each
        of the next three iterations, then let them go."""
        if not self.injected:
            return
        if not self._sentinel:
            self._sentinel.append(_take_released_slots(engine, self._free_before))
        check, release, checks_left = self._sentinel[0]
        check()
        if checks_left <= 1:
            release()
            self._sentinel[0] = (lambda: None, lambda: None, 10**9)
        else:
            self._sentinel[0] = (check, release, checks_left - 1)


def _take_released_slots(engine: Engine, free_before: dict[int, set]):
    manager = engine.manager
    tpb = manager.tokens_per_block
    allocators = manager.page_table.allocators
    released = {pg.pool_group_index: sorted(set(allocators[pg.pool_group_index].free_slots())
                                            - free_before.get(pg.pool_group_index, set()))
                for pg in manager.pool_groups}
    free = min(len(released[pg.pool_group_index]) // len(pg.layer_group_ids) for pg in manager.pool_groups)
    for index, slots in released.items():
        allocators[index].hand_out_first(slots)
    cache = manager.create_kv_cache(SENTINEL_ID, [])
    cache.resume()
    if free == 0 or not cache.resize(free * tpb):
        cache.close()
        return (lambda: None, lambda: None, 0)
    fill = list(tokens(92, free * tpb))
    pages = cache.page_indices_by_group()
    engine.fake.write_context(PassItem(SENTINEL_ID, fill, pages, 0, free * tpb, False))
    return (lambda: engine.fake.verify_cache(SENTINEL_ID, fill, pages, free * tpb), cache.close, 3)
