"""vLLM scheduler steps as plain JSON, and back as objects shaped like vLLM's `SchedulerOutput`:
what lets the driver's vLLM-free half (block tables, fingerprint pages) be proven where vLLM is not
installed, on steps vLLM 0.32.0 really scheduled (tests/data/vllm_steps.json).

A step records the fields `BlockTables.update` reads (new requests with their block ids and
computed tokens; running ones with their appended or, when resumed, whole block lists; the tokens
scheduled; the finished and preempted ids) and the `Scheduled` list the driver derived from it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvtool.vllm_compat.block_tables import Scheduled


def record_output(output: Any, scheduled: list[Scheduled]) -> dict[str, Any]:
    """One `SchedulerOutput` and the driver's `Scheduled` list for it, as JSON values."""
    cached = output.scheduled_cached_reqs
    return {
        "new": [[n.req_id, [list(g) for g in n.block_ids], n.num_computed_tokens] for n in output.scheduled_new_reqs],
        "cached": [[rid, None if b is None else [list(g) for g in b], computed, rid in cached.resumed_req_ids]
                   for rid, b, computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens,
                                               strict=True)],
        "num_scheduled": dict(output.num_scheduled_tokens),
        "finished": sorted(output.finished_req_ids),
        "preempted": sorted(output.preempted_req_ids or ()),
        "scheduled": [[s.request_id, s.start, s.end, [list(g) for g in s.blocks]] for s in scheduled],
    }


def as_output(step: dict[str, Any]) -> SimpleNamespace:
    """A recorded step with the attributes of vLLM's `SchedulerOutput` that the block tables read."""
    new = [SimpleNamespace(req_id=rid, block_ids=tuple(blocks), num_computed_tokens=computed)
           for rid, blocks, computed in step["new"]]
    cached = SimpleNamespace(req_ids=[c[0] for c in step["cached"]],
                             new_block_ids=[None if c[1] is None else tuple(c[1]) for c in step["cached"]],
                             num_computed_tokens=[c[2] for c in step["cached"]],
                             resumed_req_ids={c[0] for c in step["cached"] if c[3]})
    return SimpleNamespace(scheduled_new_reqs=new, scheduled_cached_reqs=cached,
                           num_scheduled_tokens=dict(step["num_scheduled"]),
                           finished_req_ids=set(step["finished"]), preempted_req_ids=set(step["preempted"]))


def recorded_scheduled(step: dict[str, Any]) -> list[Scheduled]:
    """The `Scheduled` list the driver derived when the step was recorded."""
    return [Scheduled(rid, start, end, tuple(tuple(g) for g in blocks))
            for rid, start, end, blocks in step["scheduled"]]
