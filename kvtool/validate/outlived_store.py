"""Evidence that a connector's store outlived its engine: offers of blocks no request of the
engine had computed before the ask. Every engine of a scenario starts with a cold store, and a
store lives no longer than one engine (its scheduler and worker objects); one kept in a module or
class attribute survives from one engine to the next in rank 0's process, while each follower rank
is a new process with every engine. So on one rank such a connector serves an earlier engine's
bytes (another model's, in a real process); on several, a follower's store lacks what rank 0's
index claims and its load hook fails (a bare KeyError, typically), which is said here in words.

Reads only a run's record and its event log (`run_record`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvtool.engine.events import Ask, Finished, PassDone
from kvtool.validate.cause_evidence import KEEP_IT_ON_THE_OBJECTS, unknown_block_offer
from kvtool.validate.run_record import FailureReason, RunRecord

_FOLLOWER_HOOK = re.compile(r"(?P<hook>\w+) \(rank (?P<rank>[1-9]\d*)\) raised (?P<error>.*)")


@dataclass(frozen=True)
class UnknownOffer:
    """An offer holding block `block` (and maybe more) that no request of this engine had computed."""

    request_id: int
    start: int
    end: int
    iteration: int
    block: int


def unknown_offers(r: RunRecord, completed_passes_only: bool = False) -> list[UnknownOffer]:
    """Every offer with a block whose tokens no request of this engine had computed (at any
    position) before the ask; with `completed_passes_only`, computed in a pass that did not fail
    for that request."""
    tpb = r.tokens_per_block
    computed: dict[int, int] = {}
    blocks: set[tuple[int, ...]] = set()
    failed_now: set[tuple[int, int]] = set()
    out = []
    for event in r.events.events:
        if isinstance(event, Finished) and event.failure is FailureReason.CONNECTOR_FAILED_IN_PASS:
            failed_now.add((event.request_id, event.iteration))
        elif isinstance(event, PassDone):
            for rid, _, end in event.items:
                if completed_passes_only and (rid, event.iteration) in failed_now:
                    continue
                tokens_so_far = r.outcomes[rid].tokens if rid in r.outcomes else []
                first, computed[rid] = computed.get(rid, 0) // tpb, max(computed.get(rid, 0), end)
                blocks.update(tuple(tokens_so_far[j * tpb:(j + 1) * tpb]) for j in range(first, computed[rid] // tpb))
        elif isinstance(event, Ask) and event.num_offered_tokens and event.request_id in r.outcomes:
            prompt = r.outcomes[event.request_id].tokens
            start, end = event.num_computed_tokens, event.num_computed_tokens + event.num_offered_tokens
            unknown = [j for j in range(start // tpb, end // tpb) if tuple(prompt[j * tpb:(j + 1) * tpb]) not in blocks]
            if unknown:
                out.append(UnknownOffer(event.request_id, start, end, event.iteration, unknown[0]))
    return out


def follower_store_lacks(r: RunRecord, request_id: int) -> str | None:
    """Why `request_id` failed, in words, when a follower rank's hook failed it while rank 0's
    scheduler had offered it blocks no request of this engine had computed in a pass that
    completed: that rank's store lacks what the index, kept from an earlier engine, claims. None
    otherwise."""
    state = r.outcomes.get(request_id)
    found = _FOLLOWER_HOOK.search(state.error or "") if state is not None else None
    offer = next((o for o in unknown_offers(r, completed_passes_only=True) if o.request_id == request_id), None)
    if found is None or offer is None:
        return None
    rank = found["rank"]
    return (f"rank {rank}'s store lacks what the scheduler's index (kept from an earlier engine) offered: request "
            f"{request_id} was offered tokens [{offer.start}, {offer.end}) at iteration {offer.iteration}, but no "
            f"request of this engine had computed block {offer.block} in a pass that completed, and rank {rank}'s "
            f"{found['hook']} raised {found['error'].split(': a request')[0]} loading it. The scheduler's index "
            f"and rank 0's store survived an earlier engine of this process; rank {rank} is a new process with "
            f"every engine, so its store started empty. {KEEP_IT_ON_THE_OBJECTS}")


def store_outlived_engine(r: RunRecord) -> list[str]:
    """The integrity check's words for offers of blocks no request of this engine computed: a
    follower's failing load said as `follower_store_lacks`, any other such offer as
    `cause_evidence.unknown_block_offer` says it (an earlier engine's bytes served, or a block
    the index claimed that no engine stored)."""
    tpb = r.tokens_per_block
    out = []
    for offer in unknown_offers(r):
        tokens = tuple(r.outcomes[offer.request_id].tokens[offer.block * tpb:(offer.block + 1) * tpb])
        out.append(follower_store_lacks(r, offer.request_id) or unknown_block_offer(
            r.run_id, offer.request_id, offer.start, offer.end, offer.iteration, offer.block, tokens))
    return out
