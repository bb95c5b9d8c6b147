"""The scenarios of `kvtool validate --compat vllm`: each builds vLLM's scheduler around the
connector under test, runs a workload that forces one case of vLLM's connector protocol, and
judges the run (`judges`). Options a scenario asks of the connector (`async_load`, `async_save`,
`defer_asks`, `fail_loads`) are kvtool-host's; a connector that ignores them runs the scenario its
own way, and a check whose case did not happen is skipped, saying so. Every scenario also passes
`store`, so that kvtool-host's in-process store is the scenario's own.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvtool.models import load_model
from kvtool.validate.results import CheckResult, Verdict
from kvtool.vllm_compat import judges
from kvtool.vllm_compat.driver import VllmRun
from kvtool.vllm_compat.engine_setup import EngineShape, build_engine
from kvtool.vllm_compat.model_config import VllmModel
from kvtool.vllm_compat.target import ConnectorTarget


@dataclass(frozen=True)
class VllmContext:
    """What every scenario of one run shares: the connector, the model, the block size, the seed."""

    target: ConnectorTarget
    model: str
    block_size: int = 4
    seed: int = 0
    folder: Path = Path(".")
    """The scenario's own temporary folder (the runner sets it)."""
    gpu: bool = False
    """Whether the scenario's pages may live on a GPU (never, with the CPU build of vLLM)."""


@dataclass(frozen=True)
class VllmScenario:
    name: str
    purpose: str
    run: Callable[[VllmContext], list[CheckResult]]


_ENGINES = itertools.count()


def engine(ctx: VllmContext, options: dict[str, Any] | None = None, **shape: Any) -> VllmRun:
    """vLLM's scheduler and kvtool's workers for this scenario: the connector with the scenario's
    `options` (where the command did not set them), the engine of `shape`."""
    extra = {"store": "{folder}", **(options or {}), **dict(ctx.target.extra)}
    target = replace(ctx.target, extra=tuple(sorted(extra.items()))).in_folder(ctx.folder)
    folder = ctx.folder / f"engine-{next(_ENGINES)}"
    built = build_engine(VllmModel.of(load_model(ctx.model)), EngineShape(block_size=ctx.block_size, **shape),
                         target, folder)
    return VllmRun(built, ctx.seed)


def prompt(ctx: VllmContext, which: int, length: int) -> list[int]:
    """A prompt of `length` tokens, different for every `which` and seed."""
    base = (ctx.seed * 7_919 + which * 104_729) % 20_000
    return [(base + i * 31) % 30_000 + 3 for i in range(length)]


def blocks(ctx: VllmContext, count: float) -> int:
    """`count` blocks' worth of tokens."""
    return int(count * ctx.block_size)


def cold_warm(ctx: VllmContext) -> list[CheckResult]:
    run = engine(ctx, prefix_caching=False)
    tokens = prompt(ctx, 1, blocks(ctx, 10.5))
    _serve(run, "cold", tokens)
    _serve(run, "warm", tokens)
    return judges.standard("cold-warm", ctx.model, run) + [judges.warm_hit("cold-warm", ctx.model, run, "warm")]


def ask_again(ctx: VllmContext) -> list[CheckResult]:
    """A repeat that cannot get blocks while a long request holds them: vLLM asks again every step
    (kvtool-host also answers None at its first ask)."""
    run = engine(ctx, {"defer_asks": 1, "async_load": True}, prefix_caching=False, blocks_per_group=20,
                 max_model_len=blocks(ctx, 20))
    tokens = prompt(ctx, 1, blocks(ctx, 10))
    _serve(run, "first", tokens)
    run.add("long", prompt(ctx, 2, blocks(ctx, 15)), max_tokens=blocks(ctx, 3))
    run.step()
    run.add("again", tokens)
    run.run()
    waited = _steps_waited(run, "again")
    checks = judges.standard("ask-again", ctx.model, run) + [judges.warm_hit("ask-again", ctx.model, run, "again")]
    checks[0].evidence.append(f"the repeat waited {waited} steps for blocks, asked again at each")
    return checks


def async_load(ctx: VllmContext) -> list[CheckResult]:
    run = engine(ctx, {"async_load": True}, prefix_caching=False)
    tokens = prompt(ctx, 1, blocks(ctx, 9.5))
    _serve(run, "cold", tokens)
    _serve(run, "warm", tokens)
    checks = judges.standard("async-load", ctx.model, run) + [judges.warm_hit("async-load", ctx.model, run, "warm")]
    parked = any("warm" in step.finished_recving for step in run.steps)
    checks[0].evidence.append("the repeat waited in WAITING_FOR_REMOTE_KVS until finished_recving" if parked
                              else "the connector loaded synchronously (no finished_recving)")
    return checks


def load_error(policy: str) -> Callable[[VllmContext], list[CheckResult]]:
    """Two requests with one prompt arrive together; the first load's last block fails (#49250:
    the second shares the first's blocks, the invalid one included, and a budget of one block a
    step spreads the recompute over several steps, while the sharer waits to read it)."""
    name = f"load-error-{policy}"

    def scenario(ctx: VllmContext) -> list[CheckResult]:
        options = {"fail_loads": 1, "async_load": VllmModel.of(load_model(ctx.model)).is_hybrid}
        run = engine(ctx, options, load_failure_policy=policy, max_num_batched_tokens=ctx.block_size,
                     max_num_seqs=2)
        tokens = prompt(ctx, 1, blocks(ctx, 8.5))
        _serve(run, "first", tokens)
        run.scheduler.reset_prefix_cache()
        run.add("x", tokens, max_tokens=3)
        run.add("y", tokens, max_tokens=3)
        run.run()
        invalid = frozenset().union(*(step.invalid_block_ids for step in run.steps))
        failed = frozenset().union(*(step.failed_recving for step in run.steps))
        if not invalid and not failed:
            return [judges.integrity(name, ctx.model, run),
                    judges.skipped(name, ctx.model, "requests-finish", "the connector reported no load error "
                                   "(it does not take kvtool-host's fail_loads option)")]
        doomed = _requests_given(run, invalid) | failed
        reasons = {rid: "error" for rid in doomed} if policy == "fail" else {}
        checks = [judges.integrity(name, ctx.model, run), judges.requests_finish(name, ctx.model, run, reasons),
                  judges.holds_nothing(name, ctx.model, run)]
        checks[0].evidence.append(f"blocks {sorted(invalid)} and loads of {sorted(failed)} reported failed; "
                                  f"policy {policy}")
        return checks

    return scenario


def preemption(ctx: VllmContext) -> list[CheckResult]:
    """Two requests outgrow the cache: the later is preempted (its blocks freed), resumed with a new
    block list (`resumed_req_ids`), served its prefix by the connector; a follow-up of its whole
    sequence then reads the blocks saved after the resume."""
    run = engine(ctx, prefix_caching=False, blocks_per_group=20,
                 max_model_len=blocks(ctx, 20))
    run.add("r1", prompt(ctx, 1, blocks(ctx, 6)), max_tokens=blocks(ctx, 9))
    run.add("r2", prompt(ctx, 2, blocks(ctx, 6)), max_tokens=blocks(ctx, 9))
    run.run()
    preempted = [rid for rid, o in run.outcomes.items() if o.num_preemptions]
    for rid in preempted[:1]:
        _serve(run, "follow-up", run.tokens(rid)[:blocks(ctx, 14)])
    checks = judges.standard("preemption", ctx.model, run)
    if not preempted:
        return checks + [judges.skipped("preemption", ctx.model, "warm-hit", "no request was preempted")]
    checks[0].evidence.append(f"{preempted[0]} preempted {run.outcomes[preempted[0]].num_preemptions} time(s), "
                              f"resumed with {run.outcomes[preempted[0]].computed_at_schedule[1:]} tokens computed")
    return checks + [judges.warm_hit("preemption", ctx.model, run, "follow-up", at_least=blocks(ctx, 7))]


def delayed_free(ctx: VllmContext, busy: bool) -> list[CheckResult]:
    """`request_finished` may answer delay_free: the blocks stay held until `finished_sending`.
    `busy`: another request keeps the step after the finish a forward; else that step is empty
    (#41945: the save must complete on a step with no forward, through `wait_for_save`)."""
    name = "delay-free" if busy else "empty-step"
    run = engine(ctx, {"async_save": True}, prefix_caching=False)
    tokens = prompt(ctx, 1, blocks(ctx, 9.5))
    if busy:
        run.add("busy", prompt(ctx, 2, blocks(ctx, 3)), max_tokens=blocks(ctx, 4))
    _serve(run, "cold", tokens)
    _serve(run, "warm", tokens)
    checks = judges.standard(name, ctx.model, run) + [judges.warm_hit(name, ctx.model, run, "warm")]
    empty = [s.index for s in run.steps if not s.num_scheduled and "wait_for_save" in run.hooks.order(s.index)]
    checks[0].evidence.append(f"steps with no forward that still ran wait_for_save: {empty[:6]}")
    return checks


def hybrid(ctx: VllmContext) -> list[CheckResult]:
    run = engine(ctx, prefix_caching=False)
    groups = run.scheduler.kv_cache_config.kv_cache_groups
    if len(groups) < 2:
        why = ("the model has one attention kind" if not VllmModel.of(load_model(ctx.model)).is_hybrid
               else "the connector is not SupportsHMA: vLLM runs it without the hybrid allocator")
        return [judges.skipped("hybrid", ctx.model, "scenario", why)]
    tokens = prompt(ctx, 1, blocks(ctx, 10.5))
    _serve(run, "cold", tokens)
    _serve(run, "warm", tokens + prompt(ctx, 3, blocks(ctx, 2)))
    return judges.standard("hybrid", ctx.model, run) + [judges.warm_hit("hybrid", ctx.model, run, "warm")]


def workers(ctx: VllmContext) -> list[CheckResult]:
    run = engine(ctx, {"async_save": True}, prefix_caching=False, num_workers=2)
    tokens = prompt(ctx, 1, blocks(ctx, 9.5))
    _serve(run, "cold", tokens)
    _serve(run, "warm", tokens)
    return judges.standard("workers", ctx.model, run) + [judges.warm_hit("workers", ctx.model, run, "warm")]


def chunked_prefill(ctx: VllmContext) -> list[CheckResult]:
    run = engine(ctx, prefix_caching=False, max_num_batched_tokens=blocks(ctx, 3))
    tokens = prompt(ctx, 1, blocks(ctx, 10.5))
    _serve(run, "cold", tokens)
    _serve(run, "warm", tokens)
    return judges.standard("chunked-prefill", ctx.model, run) + [
        judges.warm_hit("chunked-prefill", ctx.model, run, "warm")]


def prompt_lengths(ctx: VllmContext) -> list[CheckResult]:
    """Prompts ending one token past a block, on a block, one token short of one."""
    run = engine(ctx, prefix_caching=False)
    checks: list[CheckResult] = []
    for which, extra in enumerate((1, 0, -1)):
        tokens = prompt(ctx, 10 + which, blocks(ctx, 8) + extra)
        _serve(run, f"cold{extra:+d}", tokens)
        _serve(run, f"warm{extra:+d}", tokens)
        checks.append(judges.warm_hit("prompt-lengths", ctx.model, run, f"warm{extra:+d}"))
    return judges.standard("prompt-lengths", ctx.model, run) + checks


def cross_stream(ctx: VllmContext) -> list[CheckResult]:
    """#45704: a load on a side stream the forward does not wait for. Only GPU pages race."""
    return [CheckResult("cross-stream", ctx.model, "scenario", Verdict.SKIP,
                        evidence=["needs GPU pages: vLLM's CPU build allocates its KV cache on the CPU, where "
                                  "copies do not race the forward (tests/gpu holds the GPU case)"])]


def _serve(run: VllmRun, request_id: str, tokens: list[int], max_tokens: int = 3) -> None:
    """One request to its end (and every other running one with it); the local prefix cache
    reset after, so that a repeat reaches the connector."""
    run.add(request_id, tokens, max_tokens=max_tokens)
    run.run()
    run.scheduler.reset_prefix_cache()


def _steps_waited(run: VllmRun, request_id: str) -> int:
    added = next((i for i, s in enumerate(run.steps) if any(n[0] == request_id for n in s.new)), len(run.steps))
    return max(0, added - 1)


def _requests_given(run: VllmRun, block_ids: frozenset[int]) -> set[str]:
    """Requests first scheduled with any of `block_ids` in their block lists."""
    return {rid for step in run.steps for rid, groups, _ in step.new
            if block_ids & {b for group in groups for b in group}}


SCENARIOS: dict[str, VllmScenario] = {s.name: s for s in (
    VllmScenario("cold-warm", "a prompt computed, then repeated: the connector serves the repeat", cold_warm),
    VllmScenario("prompt-lengths", "prompts ending past, on and short of a block boundary, each repeated",
                 prompt_lengths),
    VllmScenario("chunked-prefill", "prompts computed in chunks of three blocks, then repeated", chunked_prefill),
    VllmScenario("ask-again", "a repeat asked again (None, then an allocation failure): no side effects", ask_again),
    VllmScenario("async-load", "loads reported through finished_recving (WAITING_FOR_REMOTE_KVS)", async_load),
    VllmScenario("load-error-recompute", "a failed load's blocks recomputed, never served (also shared, #49250)",
                 load_error("recompute")),
    VllmScenario("load-error-fail", "a failed load fails its requests (kv_load_failure_policy=fail)",
                 load_error("fail")),
    VllmScenario("preemption", "a preempted request resumed with a new block list (#29870, #32398)", preemption),
    VllmScenario("delay-free", "request_finished's delay_free: blocks held until finished_sending",
                 lambda ctx: delayed_free(ctx, busy=True)),
    VllmScenario("empty-step", "a delayed save completed on a step with no forward (#41945)",
                 lambda ctx: delayed_free(ctx, busy=False)),
    VllmScenario("hybrid", "sliding-window groups with null blocks, request_finished_all_groups (SupportsHMA)",
                 hybrid),
    VllmScenario("workers", "two workers' reports aggregated by KVOutputAggregator", workers),
    VllmScenario("cross-stream", "a load the forward must wait for on GPU pages (#45704)", cross_stream),
)}
