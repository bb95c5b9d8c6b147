"""The runtime side of the connector API: it calls the connector, checks its answers, and keeps
the asynchronous bookkeeping.

- `ask` is a side-effect-free query as far as the runtime's state goes: it memoises nothing, the
  scheduler does. `cancel`, `deliver` and `finish` are the separate commits.
- Asynchronous loads and saves are tracked per request; an id from `get_finished` is acted on only
  when every rank has reported it, and ids a rank was never given (or reports twice) are recorded
  as contract violations and ignored.
- A hook that raises never escapes: the failure is recorded and returned so the caller can fail
  the request (or the pass) cleanly.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvtool.connector.api import KvCacheConnectorScheduler, KvCacheConnectorWorker, SchedulerOutput
from kvtool.connector.raised import describe_error, format_error, stops_kvtool
from kvtool.connector.request import Request
from kvtool.errors import ConnectorError
from kvtool.group_pages import GroupPages
from kvtool.types import TextEnum


class ViolationKind(TextEnum):
    """A way a connector answered outside the API's contract (the runtime repairs the answer)."""

    ANSWER_SHAPE = "answer-shape"
    NEGATIVE_COUNT = "negative-count"
    ZERO_ASYNC = "zero-async"
    BEYOND_PROMPT = "beyond-prompt"
    WHOLE_PROMPT = "whole-prompt"
    FINISHED_SHAPE = "finished-shape"
    UNKNOWN_SAVE_ID = "unknown-save-id"
    UNKNOWN_LOAD_ID = "unknown-load-id"
    REPEATED_SAVE_ID = "repeated-save-id"
    REPEATED_LOAD_ID = "repeated-load-id"

    @property
    def is_bad_finished_id(self) -> bool:
        """`get_finished` named a request it was never given, or named it twice."""
        return self in _BAD_FINISHED_IDS

    @property
    def is_bad_answer(self) -> bool:
        """An answer of `get_num_new_matched_tokens` or `request_finished` had the wrong shape or value."""
        return not self.is_bad_finished_id

    @staticmethod
    def bad_finished_id(what: str, repeated: bool) -> ViolationKind:
        return {("save", False): ViolationKind.UNKNOWN_SAVE_ID, ("load", False): ViolationKind.UNKNOWN_LOAD_ID,
                ("save", True): ViolationKind.REPEATED_SAVE_ID, ("load", True): ViolationKind.REPEATED_LOAD_ID}[
            (what, repeated)]


_BAD_FINISHED_IDS = frozenset({ViolationKind.UNKNOWN_SAVE_ID, ViolationKind.UNKNOWN_LOAD_ID,
                               ViolationKind.REPEATED_SAVE_ID, ViolationKind.REPEATED_LOAD_ID})


class PastThePrompt(TextEnum):
    """What a runtime does with an offer past the prompt's end (always a contract violation)."""

    REPAIR = "repair"
    """Taken as `(0, False)`, the offer handed back with `cancel_load` (the release V2)."""
    REFUSE = "refuse"
    """The request fails (V1: `prepopulatedPromptLen >= promptLen`)."""
    CLAMP = "clamp"
    """Cut to the prompt, then to its last token like any offer (`main`'s V2)."""


@dataclass(frozen=True)
class ContractViolation:
    check: ViolationKind
    request_id: int | None
    detail: str


@dataclass(frozen=True)
class HookFailure:
    hook: str
    request_id: int | None
    error: str
    """`Type: message (file:line)`, the line being the connector's own (see `kvtool.connector.raised`)."""
    traceback: str = field(default="", compare=False, repr=False)
    """The whole traceback, as Python prints it ("" where none travelled, e.g. from an older follower)."""

    def describe(self) -> str:
        who = f" for request {self.request_id}" if self.request_id is not None else ""
        return f"{self.hook}{who} raised {self.error}"


@dataclass(frozen=True)
class Answer:
    num_tokens: int
    is_async: bool
    refusal: str | None = None
    """Why the runtime refuses this answer outright (the request fails), where it does: `(0, True)`
    on runtimes that raise there; None for an answer taken (maybe repaired, see the violations)."""


@dataclass
class _RankReports:
    given: set[int] = field(default_factory=set)
    reported: set[int] = field(default_factory=set)


class HookResult(NamedTuple):
    """What a guarded connector hook gave: `ok` False when it raised (the failure is recorded where
    the guard runs), and then `value` is None."""

    ok: bool
    value: Any


HOOK_FAILED = HookResult(False, None)


class ConnectorRuntime:
    def __init__(self, scheduler: KvCacheConnectorScheduler, workers: Sequence[KvCacheConnectorWorker],
                 num_ranks: int | None = None, flat_hooks: bool = False, refuse_zero_async: bool = False,
                 calls_cancel_load: bool = True, past_the_prompt: PastThePrompt = PastThePrompt.REPAIR) -> None:
        """`workers` are the ranks in this process (0, 1, ...), kept for inspection (the pass driver
        calls them); `num_ranks` counts the others too. The runtime's ways (its profile's):
        `flat_hooks`, `update_state_after_alloc` and `request_finished` called in their flat form
        with one list (TensorRT-LLM's V1); `refuse_zero_async`, an answer of `(0, True)` refused, not
        repaired (the runtimes whose query raises there); `calls_cancel_load`, unused offers handed
        back; `past_the_prompt`, what an offer past the prompt becomes."""
        self.scheduler = scheduler
        self.flat_hooks = flat_hooks
        self.refuse_zero_async = refuse_zero_async
        self.calls_cancel_load = calls_cancel_load
        self.past_the_prompt = past_the_prompt
        self.workers = list(workers)
        self.num_ranks = num_ranks or len(self.workers)
        self.violations: list[ContractViolation] = []
        self.failures: list[HookFailure] = []
        self.num_cancelled_tokens = 0
        self.around_hook: Callable[[], AbstractContextManager[None]] = nullcontext
        """Entered around every hook (the engine's `AsyncGate.hook`: the connector's threads may run)."""
        self.cancels: list[tuple[int, int, int]] = []
        self._new_loading: list[int] = []
        self._new_saving: list[int] = []
        self.num_async_loads = 0
        self.num_async_saves = 0
        self._loads = [_RankReports() for _ in range(self.num_ranks)]
        self._saves = [_RankReports() for _ in range(self.num_ranks)]
        self._load_reports: dict[int, set[int]] = {}
        self.releases: list[tuple[int, int, int, int]] = []
        """(request id, reservation id, start, end) of every `release_prefix_reservation` call."""
        self._prefix_reports: dict[int, set[int]] = {}
        self._save_reports: dict[int, set[int]] = {}

    # ---- guarded calls -----------------------------------------------------------------------
    def call(self, hook: str, fn: Callable[..., Any], *args: Any, request_id: int | None = None) -> HookResult:
        """Run a connector hook; HOOK_FAILED and a recorded failure when it raises."""
        try:
            with self.around_hook():
                return HookResult(True, fn(*args))
        except BaseException as exc:  # noqa: BLE001 - a connector must never end the runtime (sys.exit, native panics)
            if stops_kvtool(exc):
                raise
            self.failures.append(HookFailure(hook, request_id, describe_error(exc), format_error(exc)))
            return HOOK_FAILED

    def violate(self, check: ViolationKind, request_id: int | None, detail: str) -> None:
        self.violations.append(ContractViolation(check, request_id, detail))

    # ---- scheduler side ----------------------------------------------------------------------
    def ask(self, request: Request, num_computed_tokens: int) -> Answer | None:
        """The connector's answer, checked; None when the hook raised (the request must fail)."""
        ok, answer = self.call("get_num_new_matched_tokens", self.scheduler.get_num_new_matched_tokens,
                               request, num_computed_tokens, request_id=request.request_id)
        if not ok:
            return None
        return self._checked_answer(request, num_computed_tokens, answer)

    def _checked_answer(self, request: Request, num_computed: int, answer: Any,
                        hook: str = "get_num_new_matched_tokens", strict: bool = False) -> Answer:
        """The answer as the runtime takes it: a violation is recorded and repaired to `(0, False)`,
        or with `strict` (and `(0, True)` under `refuse_zero_async`) refused: the answer carries why,
        and the request fails. An offer past the prompt goes as `past_the_prompt` says."""
        rid = request.request_id
        if (not isinstance(answer, tuple) or len(answer) != 2 or not isinstance(answer[0], int)
                or isinstance(answer[0], bool) or not isinstance(answer[1], bool)):
            return self._repaired(ViolationKind.ANSWER_SHAPE, rid, f"{hook} returned {answer!r}, not (int, bool)",
                                  strict)
        num_tokens, is_async = answer
        if num_tokens < 0:
            return self._repaired(ViolationKind.NEGATIVE_COUNT, rid, f"offered {num_tokens} tokens", strict)
        if num_tokens == 0 and is_async:
            return self._repaired(ViolationKind.ZERO_ASYNC, rid, "answered (0, True): an asynchronous load of nothing",
                                  strict or self.refuse_zero_async)
        room = request.prompt_len - num_computed
        if num_tokens > room:
            detail = f"offered {num_tokens} tokens past position {num_computed} of a {request.prompt_len}-token prompt"
            if self.past_the_prompt is PastThePrompt.CLAMP:
                self.violate(ViolationKind.BEYOND_PROMPT, rid, detail)
                return Answer(room, is_async)
            answer = self._repaired(ViolationKind.BEYOND_PROMPT, rid, detail,
                                    self.past_the_prompt is PastThePrompt.REFUSE)
            if answer.refusal is None and self.calls_cancel_load:
                self.cancel(request, num_computed, num_computed + num_tokens)
            return answer
        return Answer(num_tokens, is_async)

    def _repaired(self, check: ViolationKind, request_id: int, detail: str, refuse: bool) -> Answer:
        self.violate(check, request_id, detail)
        return Answer(0, False, f"the runtime refuses the answer: {detail}" if refuse else None)

    def cancel(self, request: Request, start: int, end: int) -> bool:
        """Hand `[start, end)` back to the connector."""
        if end <= start:
            return True
        self.num_cancelled_tokens += end - start
        self.cancels.append((request.request_id, start, end))
        ok, _ = self.call("cancel_load", self.scheduler.cancel_load, request, start, end,
                          request_id=request.request_id)
        return ok

    def after_alloc(self, request: Request, pages_by_group: GroupPages) -> bool:
        """`update_state_after_alloc_by_layer_group` with fresh `List[List[int]]` (the flat form,
        with `[]`, for a request that has no KV cache: an empty group list)."""
        lists = pages_by_group.as_lists()
        grouped = bool(lists) and not self.flat_hooks
        hook = self.scheduler.update_state_after_alloc_by_layer_group if grouped else \
            self.scheduler.update_state_after_alloc
        ok, _ = self.call("update_state_after_alloc", hook, request, lists if grouped else self._flat(lists),
                          request_id=request.request_id)
        return ok

    @staticmethod
    def _flat(lists: list[list[int]]) -> list[int]:
        """The flat form of page lists: the one group's (V1 has one), [] for a request without a cache."""
        return lists[0] if len(lists) == 1 else []

    # ---- prefix reservations (`main`'s V2) ---------------------------------------------------
    def reserve(self, request: Request, num_computed_tokens: int, reservation_id: int) -> Answer | None:
        """`reserve_prefix`'s answer, checked as `get_num_new_matched_tokens`'s is; None when the
        hook raised. A malformed answer or `(0, True)` is refused (the request fails)."""
        ok, answer = self.call("reserve_prefix", self.scheduler.reserve_prefix, request, num_computed_tokens,
                               reservation_id, request_id=request.request_id)
        if not ok:
            return None
        return self._checked_answer(request, num_computed_tokens, answer, "reserve_prefix", strict=True)

    def release_reservation(self, request: Request, reservation_id: int, start: int, end: int) -> bool:
        """`release_prefix_reservation(request, reservation_id, start, end)`, recorded in `releases`."""
        self.releases.append((request.request_id, reservation_id, start, end))
        ok, _ = self.call("release_prefix_reservation", self.scheduler.release_prefix_reservation, request,
                          reservation_id, start, end, request_id=request.request_id)
        return ok

    def collect_prefix_loads(self, tracked: set[int], answers: dict[int, HookResult],
                             ignored: Collection[int] = ()) -> tuple[list[int], bool]:
        """Every rank's `get_finished_prefix_loads` answer (rank -> (ok, ids)): the ids of
        `tracked` loads every rank has now reported (each rank's reports count once), and whether
        every call was ok. An id no confirmed load has, or one a rank reports twice, is a violation;
        an `ignored` one (a load the runtime gave up on) is dropped."""
        ok = True
        for rank, (good, ids) in sorted(answers.items()):
            ok &= good
            if not good:
                continue
            if not isinstance(ids, (list, tuple)):
                self.violate(ViolationKind.FINISHED_SHAPE, None, f"rank {rank}: get_finished_prefix_loads returned "
                                                               f"{ids!r}, not a list of reservation ids")
                continue
            for rid in ids:
                if rid in ignored and rid not in tracked:
                    continue
                if rid not in tracked:
                    self.violate(ViolationKind.UNKNOWN_LOAD_ID, None, f"rank {rank} reported prefix load {rid}, "
                                                                      "which no confirmed load has")
                    continue
                ranks = self._prefix_reports.setdefault(rid, set())
                if rank in ranks:
                    self.violate(ViolationKind.REPEATED_LOAD_ID, None, f"rank {rank} reported prefix load {rid} twice")
                ranks.add(rank)
        done = sorted(rid for rid in tracked if len(self._prefix_reports.get(rid, ())) == self.num_ranks)
        for rid in done:
            del self._prefix_reports[rid]
        return done, ok

    def start_async_load(self, request_id: int) -> None:
        self._new_loading.append(request_id)
        self.num_async_loads += 1

    def build_meta(self, output: SchedulerOutput) -> HookResult:
        return self.call("build_connector_meta", self.scheduler.build_connector_meta, output)

    def finish(self, request: Request, pages_by_group: GroupPages) -> tuple[bool, bool]:
        """(hook ok, saves asynchronously)."""
        lists = pages_by_group.as_lists()
        grouped = bool(lists) and not self.flat_hooks
        hook = self.scheduler.request_finished_by_layer_group if grouped else self.scheduler.request_finished
        ok, result = self.call("request_finished", hook, request, lists if grouped else self._flat(lists),
                               request_id=request.request_id)
        if ok and not isinstance(result, bool):
            self.violate(ViolationKind.FINISHED_SHAPE, request.request_id,
                         f"request_finished returned {result!r}, not a bool")
            result = bool(result)
        if ok and result:
            self._new_saving.append(request.request_id)
            self.num_async_saves += 1
        return ok, bool(ok and result)

    # ---- worker side (the hooks themselves run in kvtool.engine.pass_driver) -----------------
    def ids_to_report(self) -> tuple[list[int], list[int]]:
        """The ids the coming `get_finished` calls hand every rank (saves, loads)."""
        return list(self._new_saving), list(self._new_loading)

    def collect_finished(self, answers: dict[int, HookResult]) -> tuple[list[int], list[int], bool]:
        """Take every rank's `get_finished` answer (rank -> (hook ok, what it returned)) for the
        ids `ids_to_report` gave out; (ids saved on all ranks, ids loaded on all ranks, every
        call ok)."""
        saving, loading = self._new_saving, self._new_loading
        self._new_saving, self._new_loading = [], []
        ok = True
        for rank, (good, result) in sorted(answers.items()):
            self._give(self._saves[rank], saving)
            self._give(self._loads[rank], loading)
            ok &= good
            if good:
                saved, loaded = self._checked_finished(rank, result)
                self._tally(rank, saved, self._saves[rank], self._save_reports, "save")
                self._tally(rank, loaded, self._loads[rank], self._load_reports, "load")
        return self._complete(self._save_reports), self._complete(self._load_reports), ok

    @staticmethod
    def _give(reports: _RankReports, ids: list[int]) -> None:
        """Ids handed out (again: a paused request's replay may save or load once more)."""
        reports.given.update(ids)
        reports.reported.difference_update(ids)

    def _checked_finished(self, rank: int, result: Any) -> tuple[list[int], list[int]]:
        if not isinstance(result, tuple) or len(result) != 2:
            self.violate(ViolationKind.FINISHED_SHAPE, None, f"rank {rank}: get_finished returned {result!r}")
            return [], []
        return list(result[0] or []), list(result[1] or [])

    def _tally(self, rank: int, ids: list[int], reports: _RankReports, tally: dict[int, set[int]], what: str) -> None:
        for rid in ids:
            if rid not in reports.given:
                self.violate(ViolationKind.bad_finished_id(what, repeated=False), rid,
                             f"rank {rank} reported {what} of request {rid}, which it was never given")
            elif rid in reports.reported:
                self.violate(ViolationKind.bad_finished_id(what, repeated=True), rid,
                             f"rank {rank} reported {what} of request {rid} twice")
            else:
                reports.reported.add(rid)
                tally.setdefault(rid, set()).add(rank)

    def _complete(self, tally: dict[int, set[int]]) -> list[int]:
        done = [rid for rid, ranks in tally.items() if len(ranks) == self.num_ranks]
        for rid in done:
            del tally[rid]
        return done

    @property
    def pending_loads(self) -> set[int]:
        return {rid for r in self._loads for rid in r.given - r.reported} | set(self._new_loading)

    @property
    def pending_saves(self) -> set[int]:
        return {rid for r in self._saves for rid in r.given - r.reported} | set(self._new_saving)


def require_grouped_hooks(scheduler_class: type, num_layer_groups: int) -> None:
    """ConnectorError for a scheduler with only the flat `update_state_after_alloc` or
    `request_finished` on a cache of several layer groups (TensorRT-LLM refuses it at start-up:
    a page index is scoped to its group, so there is no flat list to hand it)."""
    if num_layer_groups <= 1:
        return
    missing = [name for name in ("update_state_after_alloc_by_layer_group", "request_finished_by_layer_group")
               if getattr(scheduler_class, name) is getattr(KvCacheConnectorScheduler, name)]
    if missing:
        raise ConnectorError(f"{scheduler_class.__name__} does not implement {' or '.join(missing)}, and this "
                             f"KV cache has {num_layer_groups} layer groups: the flat form cannot address them")


def require_gpu_tier_only(host_cache_bytes: int, disk_cache_bytes: int) -> None:
    """A registered address is valid only while its page is pinned to the GPU tier; eviction to a
    lower tier reassigns the slot. So a connector cannot be attached when such tiers exist."""
    if host_cache_bytes or disk_cache_bytes:
        raise ConnectorError("a KV cache connector needs the GPU tier only: set the host cache size "
                             f"(now {host_cache_bytes}) and the disk cache size (now {disk_cache_bytes}) to 0")
