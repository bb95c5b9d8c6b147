"""The scenarios: each drives the connector through one hard case and judges named checks.

Token counts are in blocks of `T` tokens, so the page arithmetic (who gets deferred, whose reserve
fails) holds for any block size. Where a scenario could not create its case (the connector offered
nothing, say), its evidence says so.

Sliding windows: a real model's window is hundreds of tokens, far past these prompts at 4 tokens
per block, so the scenario about windows (`vswa-live-pages`) runs at a block size at which the
model's smallest window spans a few blocks (`window_sized`); where no affordable block size lets
its prompts pass the window, its integrity check is a SKIP saying "not exercised on MODEL".

A connector's store lives no longer than one engine (its scheduler and worker objects): a scenario
runs several engines in one process (with --num-ranks, the follower ranks are new processes with
every engine), and each starts with a cold store (a fresh folder and key namespace, `own_store`).
A connector that serves what an earlier engine saved (a store in a module or class attribute) is
told so in words by the integrity check (`judges.offers_from_elsewhere`).
"""

from __future__ import annotations

from dataclasses import replace

from kvtool.engine.events import Ask, NotHonoured
from kvtool.engine.runtimes.behaviours import Behaviour as B
from kvtool.engine.runtimes.names import RuntimeName as R
from kvtool.models import load_model, shard_model
from kvtool.validate.draft_scenarios import DRAFT_SCENARIOS
from kvtool.validate.harness import Context, Req, Scenario, reference_tokens, run, tokens
from kvtool.validate.interventions import (
    InjectedFailure,
    abort_deferred,
    evict_local_cache_after,
    release_reusable_pages,
)
from kvtool.validate.judges import (
    judge_answers,
    judge_async,
    judge_holds_nothing,
    judge_integrity,
    judge_reservations,
    judge_warm_hit,
    knock_on,
    result,
    skipped,
)
from kvtool.validate.outlived_store import follower_store_lacks
from kvtool.validate.pause_scenarios import PAUSE_SCENARIOS
from kvtool.validate.remote_scenarios import REMOTE_SCENARIOS
from kvtool.validate.reservation_scenarios import RESERVATION_SCENARIOS
from kvtool.validate.results import CheckResult, Verdict
from kvtool.validate.run_record import FailureReason, Phase, RunRecord
from kvtool.validate.sizing import sliding_windows, squeeze_slots
from kvtool.validate.store_scope import own_store


def _common(name: str, ctx: Context, r: RunRecord) -> list[CheckResult]:
    """Checks every scenario reports when it saw something to judge: async bookkeeping, answers."""
    return judge_async(name, ctx, r) + judge_answers(name, ctx, r) + judge_reservations(name, ctx, r)


def cold_warm(ctx: Context) -> list[CheckResult]:
    T = ctx.tokens_per_block
    prompt = tokens(1, 10 * T + 2)
    reqs = [Req(0, prompt), Req(1, prompt, arrival=1.0), Req(2, prompt[:6 * T] + tokens(2, 3 * T + 1), arrival=2.0)]
    r = run(ctx, reqs)
    return [judge_integrity("cold-warm", ctx, [(r, reqs)]), judge_warm_hit("cold-warm", ctx, r, [1, 2])] + \
        _common("cold-warm", ctx, r)


def chunked_prefill(ctx: Context) -> list[CheckResult]:
    T = ctx.tokens_per_block
    prompt = tokens(3, 9 * T + 3)
    reqs = [Req(0, prompt), Req(1, prompt, arrival=1.0), Req(2, prompt[:5 * T] + tokens(4, 2 * T), arrival=2.0)]
    runs = []
    for chunk in (3, 2 * T + 1):
        with own_store(f"chunk-{chunk}"):   # each engine starts with a cold store
            runs.append((run(ctx, reqs, chunk_size=chunk), reqs))
    out = [judge_integrity("chunked-prefill", ctx, runs)]
    for r, _ in runs:
        out += _common("chunked-prefill", ctx, r)
    return out


VSWA_BLOCKS = 64
"""Blocks of room in `vswa-live-pages`' pool: its six requests of at most nine blocks each, and the canary."""


def vswa_live_pages(ctx: Context) -> list[CheckResult]:
    """Every live page checked after every iteration, a canary in the last slots; at a block size
    where the prompts pass the model's smallest sliding window (`window_sized`), so that blocks go
    stale, page lists hold BAD_PAGE_INDEX, and a load or save through it hits the canary."""
    ctx, note = window_sized(ctx, VSWA_BLOCKS)
    T = ctx.tokens_per_block
    a, b = tokens(5, 8 * T + 1), tokens(6, 7 * T + 3)
    reqs = [Req(0, a), Req(1, b), Req(2, a, arrival=1.0), Req(3, b, arrival=1.0),
            Req(4, a[:5 * T] + tokens(7, 2 * T), arrival=1.0), Req(5, b[:6 * T] + tokens(8, T + 1), arrival=1.0)]
    r = run(ctx, reqs, canary=True, num_slots=squeeze_slots(ctx, VSWA_BLOCKS))
    integrity = judge_integrity("vswa-live-pages", ctx, [(r, reqs)])
    windows = sliding_windows(ctx)
    if windows and not any(len(g.stale_range(len(a), T)) for g in windows) and integrity.verdict is Verdict.PASS:
        integrity = replace(integrity, verdict=Verdict.SKIP, evidence=[
            note or f"not exercised on {load_model(ctx.model).name}: no prompt passes its smallest sliding window "
                    f"({min(g.window_size for g in windows if g.window_size is not None)} tokens) "
                    f"at {T} tokens per block"])
    elif note:
        integrity.evidence.append(note)
    return [integrity] + _common("vswa-live-pages", ctx, r)


WINDOW_BLOCKS = 4
"""A window-sized scenario runs at a block size at which the model's smallest sliding window spans
at most this many blocks, so that its prompts of eight or nine blocks pass it (tiny-vswa's 8-token
window spans 2 blocks at the default 4 tokens per block)."""
MAX_SIZED_POOL_BYTES = 512 << 20
"""The most KV one rank's pool of a window-sized scenario may hold; a model whose window no block
size within it lets the prompts pass is reported as not exercised."""


def window_sized(ctx: Context, num_blocks: int) -> tuple[Context, str]:
    """`ctx` at a block size at which the model's smallest sliding window spans at most
    WINDOW_BLOCKS blocks (a multiple of the one asked for, coarser only where needed: a real
    model's window of hundreds of tokens is hundreds of 4-token blocks), and a note saying so. When
    a pool of `num_blocks` blocks at that size would exceed MAX_SIZED_POOL_BYTES, `ctx` unchanged
    and a note saying that the window case is not exercised, and why. `ctx` and "" for a model
    without windows, or one whose window the block size asked for already lets the prompts pass."""
    model = load_model(ctx.model)
    windows = [layer.window_size for layer in model.layers if layer.window_size is not None]
    T = ctx.tokens_per_block
    if not windows or min(windows) <= WINDOW_BLOCKS * T:
        return ctx, ""
    window = min(windows)
    coarse = T * -(-window // (WINDOW_BLOCKS * T))
    shard = shard_model(model, ctx.tp_size, 0)
    per_token = sum(b.bytes_per_token(model.dtype) for layer in shard.layers for b in layer.buffers)
    pool = num_blocks * coarse * per_token
    if pool > MAX_SIZED_POOL_BYTES:
        return ctx, (f"not exercised on {model.name}: its smallest sliding window ({window} tokens) is longer than "
                     f"these prompts at {T} tokens per block; at {coarse}, where they would pass it, a pool of "
                     f"{num_blocks} blocks takes {pool / 2**30:.1f} GiB per rank (the limit is "
                     f"{MAX_SIZED_POOL_BYTES / 2**30:.1f} GiB)")
    return replace(ctx, tokens_per_block=coarse), (
        f"run at {coarse} tokens per block, not {T}, so that the prompts pass {model.name}'s smallest sliding "
        f"window ({window} tokens, {-(-window // coarse)} blocks)")


def concurrency(ctx: Context) -> list[CheckResult]:
    T = ctx.tokens_per_block
    prefixes = [tokens(9, 6 * T), tokens(10, 5 * T + 2)]
    first = [Req(i, prefixes[i % 2] + tokens(100 + i, i % 5 + 1)) for i in range(12)]
    second = [Req(12 + i, req.tokens, arrival=1.0) for i, req in enumerate(first)]
    reqs = first + second
    r = run(ctx, reqs, chunk_size=2 * T + 1, max_batch_size=6)
    return [judge_integrity("concurrency", ctx, [(r, reqs)]),
            judge_warm_hit("concurrency", ctx, r, [q.request_id for q in second])] + _common("concurrency", ctx, r)


def cache_salt(ctx: Context) -> list[CheckResult]:
    T = ctx.tokens_per_block
    prompt = tokens(11, 6 * T + 1)
    reqs = [Req(0, prompt, cache_salt="alice"), Req(1, prompt, arrival=1.0, cache_salt="bob"),
            Req(2, prompt, arrival=2.0, cache_salt="alice")]
    r = run(ctx, reqs)
    if r.error:
        return [result("cache-salt", ctx, "salt-isolation", False, [f"the run stopped: {r.error}"])]
    leaked = r.outcome(1).num_external
    evidence = [f"request 1 (salt 'bob') was served {leaked} tokens saved under salt 'alice'"] if leaked else \
        [f"salt 'bob': nothing served; salt 'alice' again: {r.outcome(2).num_external} tokens served"]
    return [result("cache-salt", ctx, "salt-isolation", not leaked, evidence),
            judge_integrity("cache-salt", ctx, [(r, reqs)])] + _common("cache-salt", ctx, r)


def contract(ctx: Context) -> list[CheckResult]:
    T = ctx.tokens_per_block
    lengths = [1, 2, T - 1, T, T + 1, 3 * T, 5 * T + 2]
    first = [Req(i, tokens(20 + i, n)) for i, n in enumerate(lengths) if n > 0]
    again = [Req(100 + q.request_id, q.tokens, arrival=1.0) for q in first]
    salted = [Req(200 + q.request_id, q.tokens, arrival=2.0, cache_salt="s") for q in first]
    reqs = first + again + salted
    r = run(ctx, reqs)
    return judge_answers("contract", ctx, r, always=True) + [judge_integrity("contract", ctx, [(r, reqs)])] + \
        judge_async("contract", ctx, r)


# ---- the protocol's edge cases -----------------------------------------------------------------


def _squeeze(ctx: Context, num_blocks: int, local_reuse: bool = False, **kwargs):
    """Request 1 repeats request 0's prompt while request 9 (ten blocks) takes most pages: with room
    for 14 blocks, 1's reserve succeeds and its first chunk does not (it is deferred); with 13, its
    reserve fails. The room is sized from the layout (a block may need a page in several groups)."""
    reqs = _squeeze_requests(ctx)
    return reqs, run(ctx, reqs, num_slots=squeeze_slots(ctx, num_blocks), local_reuse=local_reuse, **kwargs)


def _squeeze_requests(ctx: Context) -> list[Req]:
    T = ctx.tokens_per_block
    prompt = tokens(30, 4 * T + 2)
    return [Req(0, prompt), Req(9, tokens(31, 10 * T), max_new_tokens=1, arrival=1.0), Req(1, prompt, arrival=1.0)]


def _exercised(r: RunRecord, request_id: int, what: str, happened: bool) -> list[str]:
    """One evidence line: `exercised: WHAT (...)` or `not exercised: WHAT (why; ...)`, the
    parentheses holding request `request_id`'s path (`_path_of`); none when the run failed."""
    if r.error:
        return []
    if happened:
        return [f"exercised: {what} ({_path_of(r, request_id)})"]
    why = _why_not(r, request_id)
    return [f"not exercised: {what} ({why + '; ' if why else ''}{_path_of(r, request_id)})"]


def _ask_of(r: RunRecord, request_id: int) -> Ask | None:
    return next((e for e in r.events.of(Ask) if e.request_id == request_id), None)


def _why_not(r: RunRecord, request_id: int) -> str:
    """Why request `request_id` got no tokens from the connector, when it got none; else "" (its
    path says what else differed)."""
    ask, state = _ask_of(r, request_id), r.outcome(request_id)
    if ask is None:
        return "its ask failed" if state.asked else "the connector was never asked for it"
    if ask.num_offered_tokens == 0:
        return "the connector offered nothing" + (" past the local match" if ask.num_computed_tokens else "")
    return "its offer was cancelled" if state.num_external == 0 else ""


def _path_of(r: RunRecord, request_id: int) -> str:
    """`request N: asked with M tokens matched locally[, deferred Kx], D tokens delivered[, tokens
    [a, b), ... cancelled]`: what its ask, deferrals, delivery and `cancel_load` calls made of it."""
    ask, state = _ask_of(r, request_id), r.outcome(request_id)
    if ask is None:
        return f"request {request_id}: {'asked, no answer' if state.asked else 'never asked'}"
    offered, delivered = ask.num_offered_tokens, state.num_external
    words = [f"request {request_id}: asked with {ask.num_computed_tokens} tokens matched locally"]
    if state.num_deferrals:
        words.append(f"deferred {state.num_deferrals}x")
    words.append(f"{delivered} tokens delivered" if delivered == offered else
                 f"{delivered} of {offered} offered tokens delivered")
    cancels = [f"[{start}, {end})" for rid, start, end in r.cancels if rid == request_id]
    if cancels:
        words.append(f"tokens {', '.join(cancels)} cancelled")
    return ", ".join(words)


def deferral(ctx: Context) -> list[CheckResult]:
    reqs, r = _squeeze(ctx, 14)
    happened = not r.error and r.outcome(1).num_deferrals > 0 and r.outcome(1).num_external > 0
    out = [judge_integrity("deferral", ctx, [(r, reqs)]), judge_holds_nothing("deferral", ctx, r)]
    out[0].evidence += _exercised(r, 1, "asked, deferred, then delivered", happened)
    return out + _common("deferral", ctx, r)


def reserve_failure(ctx: Context) -> list[CheckResult]:
    if ctx.runtime == R.TRTLLM_V2:
        return _grow_failure(ctx)
    reqs, r = _squeeze(ctx, 13)
    happened = not r.error and any(c[0] == 1 and c[1] == 0 for c in r.cancels) and r.outcome(1).num_external == 0
    out = [judge_integrity("reserve-failure", ctx, [(r, reqs)]), judge_holds_nothing("reserve-failure", ctx, r)]
    out[0].evidence += _exercised(r, 1, "reserve failed and the offer was cancelled", happened)
    return out + _common("reserve-failure", ctx, r)


def _grow_failure(ctx: Context) -> list[CheckResult]:
    """`main`'s V2 asks once the first chunk's pages are allocated: request 1's offer reaches past its
    one-block chunk, and the allocation cannot grow to hold it while request 9 fills the pool, so
    only what the chunk's pages held is honoured and the rest is computed (never handed back)."""
    T = ctx.tokens_per_block
    prompt = tokens(30, 4 * T + 2)
    reqs = [Req(0, prompt), Req(9, tokens(31, 10 * T), max_new_tokens=6, arrival=1.0), Req(1, prompt, arrival=1.085)]
    # MAX_UTILIZATION: request 1, computing locally chunk by chunk, would take the pages request 9
    # needs to finish; it is paused instead (and asked again when it replays)
    r = run(ctx, reqs, num_slots=squeeze_slots(ctx, 13), chunk_size=T, pause_to_grow=True)
    happened = not r.error and any(e.request_id == 1 for e in r.events.of(NotHonoured))
    out = [judge_integrity("reserve-failure", ctx, [(r, reqs)]), judge_holds_nothing("reserve-failure", ctx, r)]
    out[0].evidence += _exercised(r, 1, "the allocation could not grow for the offer: only what it held was "
                                        "committed, the rest computed", happened)
    return out + _common("reserve-failure", ctx, r)


def clamp(ctx: Context) -> list[CheckResult]:
    T = ctx.tokens_per_block
    prompt = tokens(40, 4 * T)
    reqs = [Req(0, prompt), Req(1, prompt, arrival=1.0)]
    r = run(ctx, reqs)
    served = r.outcome(1).num_local_hit + r.outcome(1).num_external if 1 in r.outcomes else 0
    if ctx.runtime == R.TRTLLM_V2_RELEASE:   # the one runtime that hands the last position back
        what, happened = "whole prompt offered, last position cancelled", (1, 4 * T - 1, 4 * T) in r.cancels
    else:
        what, happened = "a prompt held whole served up to its last position, computed locally", served == 4 * T - 1
    out = [judge_integrity("clamp", ctx, [(r, reqs)]), judge_holds_nothing("clamp", ctx, r)]
    out[0].evidence += _exercised(r, 1, what, happened and not r.error)
    return out + _common("clamp", ctx, r)


def overtaken_head(ctx: Context) -> list[CheckResult]:
    T = ctx.tokens_per_block
    shared, tail = tokens(50, 2 * T), tokens(51, 2 * T + 2)
    fillers = [Req(10 + i, tokens(60 + i, 5 * T), max_new_tokens=1, arrival=1.0) for i in range(3)]
    reqs = [Req(0, shared + tail)] + fillers + [Req(8, shared + tokens(52, 8 * T - 2), max_new_tokens=1, arrival=2.0),
                                                Req(1, shared + tail, arrival=2.0)]
    r = run(ctx, reqs, num_slots=squeeze_slots(ctx, 14), local_reuse=True)
    happened = not r.error and any(c[0] == 1 and c[1] == 0 and c[2] < 4 * T for c in r.cancels) \
        and r.outcome(1).num_external > 0
    out = [judge_integrity("overtaken-head", ctx, [(r, reqs)]), judge_holds_nothing("overtaken-head", ctx, r)]
    out[0].evidence += _exercised(r, 1, "offer head overtaken by the local cache and cancelled", happened)
    return out + _common("overtaken-head", ctx, r)


def free_before_delivery(ctx: Context) -> list[CheckResult]:
    T = ctx.tokens_per_block

    prompt = tokens(30, 4 * T + 2)
    reqs = _squeeze_requests(ctx) + [Req(2, prompt, arrival=3.0)]
    followup, r2 = reqs, run(ctx, reqs, num_slots=squeeze_slots(ctx, 14), on_iteration=abort_deferred(1))
    happened = not r2.error and r2.outcome(1).error == "aborted" and any(c[0] == 1 for c in r2.cancels)
    integrity = judge_integrity("free-before-delivery", ctx, [(r2, followup)])
    out = [judge_holds_nothing("free-before-delivery", ctx, r2, followup_ok=not integrity.failed), integrity]
    out[0].evidence += _exercised(r2, 1, "freed after the ask, before delivery", happened)
    return out + _common("free-before-delivery", ctx, r2)


# ---- what a hook's arguments can be: local matches, shared blocks, follow-up turns -------------
def local_prefix(ctx: Context) -> list[CheckResult]:
    """The connector is asked with a local match (`num_computed_tokens` > 0), on a block boundary and
    inside a block, while another live request shares those pages: it must offer and load only what
    lies past the match, into the pages past it."""
    T = ctx.tokens_per_block
    b, b2 = tokens(110, 8 * T), tokens(111, 8 * T)
    reqs = [Req(0, b), Req(1, b2),
            Req(2, b[:2 * T] + tokens(112, T), arrival=1.0), Req(3, b2[:3 * T + 1], arrival=1.0),
            Req(4, b[:2 * T] + tokens(113, 2 * T), arrival=2.0), Req(5, b, arrival=2.0), Req(6, b2, arrival=2.0)]
    r = run(ctx, reqs, local_reuse=True, on_iteration=evict_local_cache_after(0.0))
    out = [judge_integrity("local-prefix", ctx, [(r, reqs)]), judge_warm_hit("local-prefix", ctx, r, [2, 3, 5, 6])]
    for request_id, where in ((5, "on a block boundary"), (6, "inside a block")):
        out[0].evidence += _exercised(r, request_id, f"a local match {where}, more delivered",
                                      _delivered_past_a_local_match(r, request_id))
    return out + _common("local-prefix", ctx, r)


def _delivered_past_a_local_match(r: RunRecord, request_id: int) -> bool:
    """Whether request `request_id` was asked with a local match and delivered tokens past it
    (each sub-case judged by its own request: one declined does not hide the other)."""
    ask = None if r.error else _ask_of(r, request_id)
    return ask is not None and ask.num_computed_tokens > 0 and r.outcome(request_id).num_external > 0


def moved_blocks(ctx: Context) -> list[CheckResult]:
    """Equal tokens are not equal KV: a block's KV depends on everything before it. Later prompts
    hold the first prompt's blocks at other positions, or at the same positions after another first
    block, or one block repeated; only a true prefix may be served."""
    T = ctx.tokens_per_block
    x, y, z, w, v = (tokens(120 + i, T) for i in range(5))
    reqs = [Req(0, x + y + z + w + x[:2]),
            Req(1, y + z + w + x + y[:1], arrival=1.0),      # every block moved one position down
            Req(2, v + y + z + w + x[:2], arrival=1.0),      # the same blocks at the same places, after another head
            Req(3, x + x + x + y[:3], arrival=1.0),          # the first block, repeated
            Req(4, x + y + v + w + x[:2], arrival=2.0)]      # diverges, then converges again
    r = run(ctx, reqs)
    served = {i: r.outcome(i).num_external for i in (1, 2, 3, 4)} if not r.error else {}
    out = [judge_integrity("moved-blocks", ctx, [(r, reqs)])]
    out[0].evidence += [f"tokens served for prompts that share only moved blocks or a true prefix: {served}"]
    return out + _common("moved-blocks", ctx, r)


def multi_turn(ctx: Context) -> list[CheckResult]:
    """Chat follow-ups: the next prompt is the previous prompt, its answer and new tokens. The last
    answer token's KV was never computed (nothing ran after it was sampled), so a connector that
    saves the finished request's tokens as written serves an unwritten position. Turns end on a
    block boundary and inside a block; another follow-up extends a prompt that ended mid-block."""
    T = ctx.tokens_per_block
    first = [Req(0, tokens(130, 4 * T - 2)), Req(1, tokens(131, 3 * T + 1)), Req(2, tokens(132, 3 * T + 2)),
             Req(3, tokens(137, 3 * T))]
    answers = reference_tokens(ctx, first)
    turns = [Req(10 + q.request_id, q.tokens + tuple(answers[q.request_id]) + tokens(133 + q.request_id, 2 * T),
                 arrival=1.0) for q in first[:2]]
    others = [Req(12, first[2].tokens + tokens(136, 2 * T), arrival=1.0),   # extends a prompt that ended mid-block
              Req(13, first[3].tokens + tokens(138, T), arrival=1.0),       # ... one that ended on a boundary
              Req(14, first[0].tokens[:2 * T], arrival=1.0)]                # a prefix ending on a boundary
    reqs = first + turns + others
    r = run(ctx, reqs)
    out = [judge_integrity("multi-turn", ctx, [(r, reqs)]), judge_warm_hit("multi-turn", ctx, r, [10, 11, 12, 13, 14])]
    return out + _common("multi-turn", ctx, r)


def final_pass_blocks(ctx: Context) -> list[CheckResult]:
    """Blocks a request completes in its last pass: its pages are released right after that pass
    (unless `request_finished` answers True), and here no local cache keeps them (a prefill server
    hands its requests off; memory pressure evicts). Context-only requests (one new token, as
    disaggregated prefill sends them) ending on and off a block boundary, and answers whose last
    computed position ends a block; later the same prompts, and the conversations continued. A
    connector that copies a pass's saves after the pass (at the next `start_load_kv`, say) without
    asking the runtime to keep the pages copies released pages, and the repeats load them."""
    T = ctx.tokens_per_block
    prefill = [Req(0, tokens(140, 6 * T), max_new_tokens=1), Req(1, tokens(141, 5 * T + 2), max_new_tokens=1)]
    # the last pass computes position prompt_len + n - 2: it completes a block when prompt_len + n - 1 is a
    # multiple of T
    chat = [Req(2, tokens(142, 3 * T + 1), max_new_tokens=T), Req(3, tokens(143, 2 * T + 1), max_new_tokens=2 * T)]
    answers = reference_tokens(ctx, prefill + chat)
    again = [Req(10 + q.request_id, q.tokens, arrival=1.0) for q in prefill] + \
        [Req(10 + q.request_id, q.tokens + tuple(answers[q.request_id]) + tokens(144 + q.request_id, T + 1),
             arrival=1.0)
         for q in chat]
    reqs = prefill + chat + again
    r = run(ctx, reqs, on_iteration=release_reusable_pages)
    out = [judge_integrity("final-pass-blocks", ctx, [(r, reqs)]),
           judge_warm_hit("final-pass-blocks", ctx, r, [q.request_id for q in again])]
    if not r.error:     # a load of released-page bytes is named by judge_integrity (`released_page_loads`)
        out[0].evidence += [f"tokens served to the repeats of prompts whose last blocks were completed in their "
                            "request's last pass: "
                            f"{ {q.request_id: r.outcome(q.request_id).num_external for q in again} }"]
    return out + _common("final-pass-blocks", ctx, r)


# ---- asynchronous paths and failures -----------------------------------------------------------
def async_load(ctx: Context) -> list[CheckResult]:
    T = ctx.tokens_per_block
    prompt = tokens(70, 7 * T + 1)
    reqs = [Req(0, prompt), Req(1, prompt, arrival=1.0), Req(2, prompt, arrival=1.0)]
    r = run(ctx, reqs)
    checks = judge_async("async-load", ctx, r)
    if not any(c.check == "load-completes" for c in checks):
        checks.append(skipped("async-load", ctx, "load-completes", "the connector loaded synchronously"))
    return checks + [judge_integrity("async-load", ctx, [(r, reqs)])] + judge_answers("async-load", ctx, r)


def async_save(ctx: Context) -> list[CheckResult]:
    """Request 0's last pass completes a block (its save is in flight when `request_finished`
    answers), and get_finished is polled right after: a connector that reports the save before
    its copy landed has its pages released and poisoned at once, and request 2, which continues
    the conversation, loads that block. Request 1 repeats the prompt while nothing is in flight."""
    T = ctx.tokens_per_block
    prompt = tokens(80, 7 * T - 1)
    first = Req(0, prompt)       # the last pass computes position 7T - 1: it completes block 6
    answer = reference_tokens(ctx, [first])[0]
    reqs = [first, Req(1, prompt, arrival=1.0), Req(2, prompt + tuple(answer) + tokens(81, T + 1), arrival=2.0)]
    r = run(ctx, reqs)
    checks = judge_async("async-save", ctx, r)
    if not any(c.check == "finished-ids" for c in checks):
        checks.append(skipped("async-save", ctx, "finished-ids", "the connector saved synchronously"))
    return checks + [judge_integrity("async-save", ctx, [(r, reqs)])] + judge_answers("async-save", ctx, r)


def hook_raises(ctx: Context) -> list[CheckResult]:
    """Run twice, with and without a failure injected into `wait_for_layer_load` in the pass that
    loads the warm request (else its first pass): only what goes wrong *because* of the failure
    counts against survival. After the failure a sentinel takes every free slot for a few
    iterations, so a connector that writes into the failed request's released pages is caught; and
    later requests repeat both failed prompts, so a connector that indexed the failed pass's saves
    (which never landed) serves what it never stored."""
    T = ctx.tokens_per_block
    prompt, other = tokens(90, 6 * T + 1), tokens(91, 5 * T)
    reqs = [Req(0, prompt), Req(1, prompt, arrival=1.0), Req(2, other, arrival=1.0),
            Req(3, prompt, arrival=3.0), Req(4, other, arrival=4.0)]
    runs = []
    for fail in (False, True):   # the baseline sees the same sentinel at the same point, without the failure
        injection = InjectedFailure(fail)
        with own_store("failing" if fail else "baseline"):   # a disk store must start cold in both
            runs.append(run(ctx, reqs, setup=injection.setup, on_iteration=injection.after_iteration))
    baseline, r = runs
    return [_judge_survival(ctx, r, baseline, reqs, injection.injected, injection.admitted),
            judge_integrity("hook-raises", ctx, [(baseline, reqs)])] + judge_answers("hook-raises", ctx, r)


CONNECTOR_RAISED = frozenset({FailureReason.ASK_RAISED, FailureReason.ALLOC_HOOK_RAISED,
                              FailureReason.FINISHED_HOOK_RAISED, FailureReason.CONNECTOR_FAILED_IN_PASS})
"""Failures a connector's own code raised (not a wall-clock limit a busy machine can reach)."""


def _judge_survival(ctx: Context, r: RunRecord, baseline: RunRecord, reqs: list[Req], injected: list[int],
                    admitted: set[int]) -> CheckResult:
    if r.error:
        return result("hook-raises", ctx, "survives-hook-failure", False, [f"the run stopped: {r.error}"])
    evidence = [] if injected else [knock_on(r, "no failure could be injected")]
    already_wrong = set(baseline.integrity.errors_by_request)
    newly_wrong = set(r.integrity.errors_by_request) - already_wrong
    evidence += [f"after the failure: {i.describe()}" for i in r.integrity.issues if i.request_id in newly_wrong][:5]
    evidence += [f"{r.integrity.errors_by_request[rid]} integrity errors in request {rid} only when the failure "
                 "happened" for rid in sorted(newly_wrong)]
    expected = reference_tokens(ctx, reqs)
    evidence += [f"request {rid} generated {s.generated_token_ids} after the failure, "
                 f"expected {expected[rid]}" for rid, s in r.outcomes.items()
                 if s.phase is Phase.DONE and s.generated_token_ids != expected[rid]
                 and baseline.outcome(rid).generated_token_ids == expected[rid]]
    evidence += [f"request {rid} never finished ({s.phase.value})" for rid, s in r.outcomes.items() if s.is_live]
    failed = [rid for rid, s in r.outcomes.items() if s.phase is Phase.FAILED]
    evidence += [follower_store_lacks(r, rid) or
                 f"request {rid} was admitted after the failure and failed only when it happened "
                 f"({r.outcome(rid).error}):"
                 " did the connector offer blocks of the failed pass, whose saves never landed?"
                 for rid in failed if rid not in admitted and r.outcome(rid).failure in CONNECTOR_RAISED
                 and baseline.outcome(rid).phase is not Phase.FAILED]
    if r.introspection is not None:
        kept = sorted(set(r.introspection.tracked_request_ids or ()) & set(failed))
        evidence += [f"still tracks failed request {rid}" for rid in kept]
    later = [rid for rid, s in r.outcomes.items() if s.phase is Phase.DONE and s.arrival > 0]
    summary = [f"failure injected in iteration {injected[0] if injected else '-'}; failed {failed}; "
               f"served afterwards {later}"]
    return result("hook-raises", ctx, "survives-hook-failure", not evidence, evidence + summary)


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("cold-warm", "cold miss then warm hit; every loaded byte checked by the fingerprints", cold_warm,
             exercises=(B.WHEN_ASKED, B.FIRST_CHUNK_PAGES, B.HOOK_FORMS)),
    Scenario("chunked-prefill", "later chunks arrive as append-deltas, chunk sizes 3 and 2T+1", chunked_prefill,
             exercises=(B.FIRST_CHUNK_PAGES, B.HOOK_FORMS)),
    Scenario("vswa-live-pages", "all live pages of all requests checked after every iteration, with a canary in "
                                "the last slot (what an index of -1 hits)", vswa_live_pages,
             exercises=(B.FIRST_CHUNK_PAGES,)),
    Scenario("deferral", "deferred for lack of pages (asked before or after, as the runtime asks), delivered later",
             deferral, exercises=(B.WHEN_ASKED, B.PREFIX_RESERVATIONS)),
    Scenario("reserve-failure", "the offer's pages cannot be reserved: handed back (cancel_load) or only what was "
                                "honoured committed, the rest computed locally", reserve_failure,
             exercises=(B.UNUSED_OFFER, B.WHEN_ASKED, B.PREFIX_RESERVATIONS),
             runs_on=frozenset({R.TRTLLM_V2, R.TRTLLM_V2_RELEASE}),
             not_here="V1 grants the whole prompt's pages before it asks: no allocation is left to fail for the offer"),
    Scenario("clamp", "a prompt the connector holds whole: the last position is computed locally", clamp,
             exercises=(B.WHOLE_PROMPT_OFFER, B.UNUSED_OFFER, B.PREFIX_RESERVATIONS)),
    Scenario("overtaken-head", "the local cache overtook the offer's head: the head is cancelled", overtaken_head,
             exercises=(B.WHEN_ASKED, B.UNUSED_OFFER), runs_on=frozenset({R.TRTLLM_V2_RELEASE}),
             not_here="a request is asked only once its pages are granted, so no local match can overtake its offer"),
    Scenario("free-before-delivery", "a request freed after the ask, before delivery", free_before_delivery,
             exercises=(B.WHEN_ASKED, B.UNUSED_OFFER), runs_on=frozenset({R.TRTLLM_V2_RELEASE}),
             not_here="the ask and the delivery are one step: no request can be freed between them"),
    Scenario("local-prefix", "asked with a local match, on a block boundary and inside a block, while another "
                             "request shares those pages: only what lies past the match is loaded", local_prefix,
             exercises=(B.FIRST_CHUNK_PAGES,)),
    Scenario("moved-blocks", "blocks equal in tokens but not in prefix (moved, repeated, after another head) "
                             "are never served", moved_blocks),
    Scenario("multi-turn", "follow-ups extend a prompt and its answer, or a prompt that ended mid-block",
             multi_turn),
    Scenario("final-pass-blocks", "blocks completed in a request's last pass (context-only requests, answers "
                                  "ending a block), their pages released at once; then repeated", final_pass_blocks,
             exercises=(B.FIRST_CHUNK_PAGES,)),
    Scenario("async-load", "asynchronous loads complete within 20 iterations", async_load,
             exercises=(B.WHEN_ASKED, B.ZERO_ASYNC)),
    Scenario("async-save", "asynchronous saves: get_finished ids, pages alive until reported", async_save),
    Scenario("hook-raises", "a worker hook raises mid-pass: the runtime survives, later requests are "
                            "served correctly", hook_raises),
    Scenario("contract", "prompts of 1 token to several blocks, repeated and salted: answers in contract", contract,
             exercises=(B.WHOLE_PROMPT_OFFER, B.ZERO_ASYNC)),
    Scenario("cache-salt", "no hit across cache salts", cache_salt),
    Scenario("concurrency", "many requests sharing prefixes at once, chunked, small batches", concurrency,
             exercises=(B.FIRST_CHUNK_PAGES, B.WHEN_ASKED)),
    *PAUSE_SCENARIOS,
    *RESERVATION_SCENARIOS,
    *DRAFT_SCENARIOS,
    *REMOTE_SCENARIOS,
)}
