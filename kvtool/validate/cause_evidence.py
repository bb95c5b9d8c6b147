"""Evidence that names the cause of a wrong load, and gives a hint only where it fits.

- an offer of a block no request of this engine computed: served from an earlier engine's store
  (a store that outlives the connector objects), or, when no engine of the scenario with a
  connector computed it either, a block the connector's index claimed without ever storing it;
- a load of poison (0xde: a released page; 0xa5: one handed out again): the block's saver answered True from
  request_finished and
  get_finished reported the save before its copy landed (the gate makes the report the moment of
  judgement), or the connector copied the block after its pages were released without asking to
  keep them; or, where kvtool held the connector's background work and the save's work ran
  before its report, the request's own load: work `start_load_kv` started ran when kvtool's
  schedule let it (the latest point at the default seed) and never wrote the request's pages.
"""

from __future__ import annotations

from kvtool.engine.events import Deliver, LoadStarted, PassDone, SaveFinished, SaveStarted, WorkRan
from kvtool.validate.run_record import RunRecord

KEEP_IT_ON_THE_OBJECTS = ("A store must live no longer than the connector objects (one engine): keep it on the "
                          "scheduler and worker, not in a module or class attribute (each engine of a scenario starts "
                          "with a cold store, and with --num-ranks the other ranks' processes are new with every "
                          "engine)")

_BLOCKS_BY_ENGINE: dict[int, set[tuple[int, ...]]] = {}
"""Blocks (their tokens) each engine with a connector computed in this process (by run id) since
the last `forget_engines`: what a store kept beyond its engine could serve another."""


def forget_engines() -> None:
    """A new scenario: no engine before it counts."""
    _BLOCKS_BY_ENGINE.clear()


def note_engine_blocks(run_id: int, blocks: set[tuple[int, ...]]) -> None:
    """The blocks the engine of run `run_id`, with a connector, computed (called once its run is over)."""
    _BLOCKS_BY_ENGINE[run_id] = blocks


def computed_blocks(r: RunRecord) -> set[tuple[int, ...]]:
    """The tokens of every full block a request of `r` computed."""
    tpb = r.tokens_per_block
    blocks: set[tuple[int, ...]] = set()
    for event in r.events.of(PassDone):
        for rid, _, end in event.items:
            if rid in r.outcomes:
                tokens_so_far = r.outcomes[rid].tokens
                blocks.update(tuple(tokens_so_far[j * tpb:(j + 1) * tpb]) for j in range(end // tpb))
    return blocks


def unknown_block_offer(run_id: int, request_id: int, start: int, end: int, iteration: int, block: int,
                        block_tokens: tuple[int, ...]) -> str:
    """Why an offer holds `block`, which no request of this engine had computed before the ask."""
    offered = (f"request {request_id} was offered tokens [{start}, {end}) at iteration {iteration}, but no request "
               f"of this engine had computed the tokens of its block {block}")
    if any(block_tokens in blocks for other, blocks in _BLOCKS_BY_ENGINE.items() if other != run_id):
        return f"{offered}: the connector serves what an earlier engine saved. {KEEP_IT_ON_THE_OBJECTS}"
    return (f"{offered}, nor had any earlier engine: no request stored block {block}, yet the connector's index "
            "claimed it (an off-by-one in the matched count, or a key that names another block?)")


def released_page_load(r: RunRecord, request_id: int, block: int, released: bool) -> str | None:
    """Why request `request_id` loaded poison into `block` (`released`: the bytes a page gets when
    freed, 0xde; else those it gets when handed out again, 0xa5): said by what the requests that
    computed that block before it did with their saves; None where neither cause fits."""
    tpb = r.tokens_per_block
    tokens = r.outcome(request_id).tokens[:(block + 1) * tpb]
    savers = [rid for rid, s in r.outcomes.items() if rid != request_id and len(tokens) == (block + 1) * tpb
              and s.tokens[:len(tokens)] == tokens]
    reported = {e.request_id: e.iteration for e in r.events.of(SaveFinished)}
    started = {e.request_id for e in r.events.of(SaveStarted)}
    early = [rid for rid in savers if rid in started and rid in reported]
    if not released and not any(save_ran_after_report(r, rid) for rid in early):
        late_load = late_load_work(r, request_id)
        if late_load is not None:
            return late_load
    if early:
        saver = early[0]
        return (f"request {request_id} loaded poison into block {block}: request {saver} saved it asynchronously "
                f"(request_finished answered True), and get_finished reported that save at iteration "
                f"{reported[saver]} before its bytes were in the store (its pages were released and poisoned at "
                "the report; the copy read them afterwards). Report a save only once its copy has landed")
    if r.stream_races and not released:
        return stream_order(r, request_id, block, savers[0] if savers else None)
    if released:
        return (f"request {request_id} loaded a released page's bytes: the connector copied a block after its "
                "request's last pass released its pages (save a block in the pass that completes it, or answer "
                "True from request_finished to keep the pages until get_finished reports the save)")
    return None


SAVE_HOOKS = ("save_kv_layer", "wait_for_save")


def stream_order(r: RunRecord, request_id: int, block: int, saver: int | None) -> str:
    """Why request `request_id` read never-written bytes in a block the connector loaded, on
    device pages whose streams lose every race (`engine.stream_races`): its load landed after the
    pass that needed it, or the block's save copied before the layer wrote it."""
    delivered = max((e.iteration for e in r.events.of(Deliver) if e.request_id == request_id), default=None)
    when = f" in iteration {delivered}" if delivered is not None else ""
    save = (f"the save of request {saver}, which computed the block, copied it on a stream not ordered after the "
            "stream save_kv_layer / wait_for_save received (make the copy's stream wait for it first): it read the "
            "bytes from before the layer wrote them") if saver is not None else \
        "the block's save copied it before the layer wrote it (a stream not ordered after the hook's stream)"
    return (f"request {request_id} read bytes its block {block} never had, where the connector loaded it{when}: "
            "on device pages kvtool reads loaded pages as soon as wait_for_layer_load returns and delays each "
            "layer's writes on the forward stream (a device-side spin), so stream order decides. Either its load, "
            f"started by start_load_kv{when}, was not ordered before the stream wait_for_layer_load received "
            "(record an event after the copy and make that stream wait for it): it landed after the pass that "
            f"needed it; or {save}")



def save_ran_after_report(r: RunRecord, saver: int) -> bool:
    """Whether held save work started before `saver` finished ran at or after the iteration that
    reported its save (only held work says so; a report with none known is taken as early)."""
    finished = max((e.iteration for e in r.events.of(SaveStarted) if e.request_id == saver), default=None)
    reported = min((e.iteration for e in r.events.of(SaveFinished) if e.request_id == saver), default=None)
    saves = [w for w in r.events.of(WorkRan) if w.started_by in SAVE_HOOKS]
    if finished is None or reported is None or not saves:
        return True
    return any(w.started_at <= finished and w.iteration >= reported for w in saves)


def late_load_work(r: RunRecord, request_id: int) -> str | None:
    """Evidence that request `request_id`'s asynchronous load, held by kvtool, ran after the pass
    that started it and never wrote its pages (None where no such load is known)."""
    starts = [e.iteration for e in r.events.of(LoadStarted) if e.request_id == request_id and e.is_async]
    if not starts:
        return None
    ran = [w for w in r.events.of(WorkRan) if w.started_by == "start_load_kv" and w.started_at == starts[-1]]
    if not ran:
        return None
    work = ran[-1]
    bound = ", after the next pass's metadata was bound" if work.iteration > work.started_at else ""
    return (f"request {request_id}'s load never wrote its pages: the background work start_load_kv started for it "
            f"in iteration {work.started_at} ran in iteration {work.iteration} ({_released_why(work.reason)})"
            f"{bound}. A background load must copy what it was handed when it started (the metadata of its own "
            "pass), not the connector's state when it runs")


def _released_why(reason: str) -> str:
    """Words for `WorkRan.reason`."""
    if reason == "waited":
        return "when the connector waited for it"
    if reason in ("idle", "end"):
        return "when nothing else could run" if reason == "idle" else "at the end of the run"
    return "held by kvtool to the latest point the contract allows" if reason == "NEXT_GATE" else \
        f"released by kvtool's schedule at {reason}"


POISONS = {"a released page": True, "a page that was never written": False}
"""How the fake engine's evidence starts for each poison, and whether it is the released one."""


def released_page_loads(r: RunRecord) -> list[str]:
    """A `released_page_load` line per request that loaded poison through the connector, where
    the cause is one of its two."""
    seen: dict[int, tuple[int, bool]] = {}
    for issue in r.integrity.issues:
        state = r.outcomes.get(issue.request_id)
        kind = next((released for start, released in POISONS.items() if issue.found.startswith(start)), None)
        if state is not None and kind is not None and issue.request_id not in seen \
                and state.num_local_hit <= issue.position < state.num_local_hit + state.num_external:
            seen[issue.request_id] = (issue.block_ordinal, kind)
    lines = [released_page_load(r, rid, block, kind) for rid, (block, kind) in seen.items()]
    return [line for line in lines if line]
