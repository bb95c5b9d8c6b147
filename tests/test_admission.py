"""Output reservation (kvtool/engine/admission.py, TensorRT-LLM's GUARANTEED_NO_EVICT) on a small
manager: exact page counts reserved per pool group, and which newcomer fits."""

from __future__ import annotations

from kvtool.connector.request import Request
from kvtool.engine.admission import OutputReservation
from kvtool.engine.request_state import RequestState
from kvtool.manager import KvCacheManager
from tests.helpers.managers import make_manager


def started(manager: KvCacheManager, request_id: int, prompt_len: int, max_new_tokens: int) -> RequestState:
    """A request whose prompt already holds its pages (4 tokens a block)."""
    tokens = list(range(100 * request_id, 100 * request_id + prompt_len))
    state = RequestState(Request(request_id, tokens, max_new_tokens=max_new_tokens))
    state.kv = manager.create_kv_cache(request_id)
    assert state.kv.resume() and state.kv.resize(prompt_len)
    return state


def test_a_pass_starts_with_the_growth_the_running_requests_still_owe():
    manager = make_manager("tiny", 4, num_slots=8)
    reservation = OutputReservation(manager)
    running = [started(manager, 1, 8, 8), started(manager, 2, 4, 1)]   # owe 16/4 - 2 = 2 and 2 - 1 = 1 pages
    newcomer = started(manager, 3, 4, 0)                                 # owes nothing: 1 page, 4 tokens
    assert manager.page_table.num_available(0) == 4
    reservation.start_pass(running)
    assert reservation.admit(newcomer, alone=False)                     # 3 + 0 <= 4
    starved = started(manager, 4, 4, 8)                                  # 3 pages used, owes 3 - 1 = 2
    assert manager.page_table.num_available(0) == 3
    assert not reservation.admit(starved, alone=False)                  # 3 reserved + 2 > 3


def test_a_refused_newcomer_reserves_nothing_and_one_alone_is_admitted_whatever_it_owes():
    manager = make_manager("tiny", 4, num_slots=8)
    reservation = OutputReservation(manager)
    greedy = started(manager, 1, 4, 100)                                 # owes 26 pages: more than the pool
    reservation.start_pass([])
    assert not reservation.admit(greedy, alone=False)
    small = started(manager, 2, 4, 4)                                    # owes 1 of the 6 left
    assert reservation.admit(small, alone=False)                        # the refusal reserved nothing
    assert reservation.admit(greedy, alone=True)                        # a request alone always runs


def test_a_window_group_reserves_only_up_to_its_window():
    manager = make_manager("tiny-vswa", 4, num_slots=8)                 # group 0: window of 8 tokens
    reservation = OutputReservation(manager)
    long_output = started(manager, 1, 8, 24)                             # full group owes 32/4 - 2 = 6 pages
    reservation.start_pass([long_output])
    probe = started(manager, 2, 4, 0)
    assert [manager.page_table.num_available(pg) for pg in (0, 1)] == [5, 5]
    assert not reservation.admit(probe, alone=False)                    # full group: 6 > 5
    fresh = OutputReservation(manager)
    fresh.start_pass([])
    window_heavy = started(manager, 3, 4, 4)                             # owes 1 full page, window keeps 2
    assert fresh.admit(window_heavy, alone=False)
