"""`kvtool bench --suite store --compat vllm`: a vLLM connector's save and load paths through vLLM
0.32.0's own scheduler and kvtool's fingerprinting workers, in the columns of every other store run
(`protocol_suite.ProtocolRow`).

Per block size and round, a fresh engine (no local prefix caching, so the connector serves every
repeat; a budget that schedules a round's prompts in one step, as a serving batch would) runs a cold
round (N prompts of K full blocks plus half a block, one new token each: the connector saves them),
vLLM's prefix cache reset, then a warm round of the same prompts under new ids (it loads them).

Timing: the wall clock inside the worker hooks (`protocol_engine.SAVE_HOOKS` in the cold round,
`LOAD_HOOKS` in the warm one), their union over the round; a request's latency is the union of
those hooks in the steps that scheduled it (vLLM's hooks take a step, not a request). Blocks: the
cold round's full prompt blocks; the warm round's blocks the connector delivered (the tokens vLLM
scheduled a request with as computed). `connector_ms` is the time inside every worker hook (vLLM's
scheduler calls the connector's scheduler side itself, untimed). Verified: no wrong byte read and
every warm request generated its cold request's token.
"""

from __future__ import annotations

import gc
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kvtool.bench.protocol_engine import LOAD_HOOKS, SAVE_HOOKS, Measured, Workload, four_digits, union
from kvtool.bench.protocol_suite import ProtocolRow, protocol_row, raw_gbps, reference_label, run_protocol_suite
from kvtool.connector.loader import ConnectorSpec
from kvtool.models import load_model
from kvtool.vllm_compat.driver import VllmRun
from kvtool.vllm_compat.engine_setup import EngineShape, build_engine
from kvtool.vllm_compat.model_config import VllmModel
from kvtool.vllm_compat.target import ConnectorTarget


def run_vllm_store_suite(target: ConnectorTarget, model: str, tokens_per_block: list[int], workload: Workload,
                         repeats: int, rounds: int, reference: tuple[ConnectorSpec, dict[str, str]]
                         ) -> tuple[list[ProtocolRow], list[str]]:
    """A save and a load row per block size for the vLLM connector (each over `rounds` fresh
    engines), then kvtool's `reference` connector through kvtool's engine on the same workload in
    this run (`protocol_suite.run_protocol_suite`), every row's `vs_reference` against it; and one
    line per failed check (bytes not verified, nothing served in a warm round)."""
    rows, problems = [], []
    for tpb in tokens_per_block:
        results = []
        for _ in range(rounds):
            with tempfile.TemporaryDirectory(prefix="kvtool-vllm-bench-") as folder:
                results.append(run_vllm_block_size(target, model, tpb, workload, Path(folder)))
            gc.collect()
        rows += _rows(target.label, model, tpb, results, repeats)
        issue = next((r.issue for r in results if r.issue is not None), None)
        where = f"{target.label} (vLLM), {tpb} tokens per block"
        problems += [f"{where}: not verified: {issue}"] if issue else []
        problems += [f"{where}: the connector served nothing in the warm round"] if any(
            r.load.blocks == 0 for r in results) else []
    ref_rows, ref_problems = run_protocol_suite(reference[0], reference[1], model, tokens_per_block, workload,
                                                repeats, "cpu", None, rounds)
    for row in ref_rows:
        row.connector = reference_label(reference)
    yardstick = {(r.direction, r.tokens_per_block): r.gbps for r in ref_rows}
    for row in rows + ref_rows:
        base = yardstick.get((row.direction, row.tokens_per_block))
        row.vs_reference = four_digits(row.gbps / base) if base else None
    return rows + ref_rows, problems + ref_problems


def _rows(label: str, model: str, tpb: int, results: list[VllmBlockSize], repeats: int) -> list[ProtocolRow]:
    rows = []
    for direction in ("save", "load"):
        measured = [getattr(r, direction) for r in results]
        nbytes = max(measured[0].blocks, 1) * results[0].block_bytes
        rows.append(protocol_row(f"{label} (vLLM)", direction, model, tpb, results[0].block_bytes, measured,
                                 raw_gbps(nbytes, repeats, "cpu", direction), all(r.issue is None for r in results)))
    return rows


@dataclass(frozen=True)
class VllmBlockSize:
    """One round of one block size: bytes per block (every layer), the save and the load measured,
    and why the bytes are not verified (None when they are)."""

    block_bytes: int
    save: Measured
    load: Measured
    issue: str | None


def run_vllm_block_size(target: ConnectorTarget, model: str, tokens_per_block: int, workload: Workload,
                        folder: Path) -> VllmBlockSize:
    """The cold and the warm round on a fresh engine in `folder` (module docstring). A connector's
    exception propagates (`hook_log.HookFailed` from a worker hook)."""
    prompts = workload.fresh_prompts(tokens_per_block)
    run = _engine(target, model, tokens_per_block, workload, folder, len(prompts[0]))
    cold = _round(run, "cold", prompts, workload.per_pass)
    run.scheduler.reset_prefix_cache()
    warm = _round(run, "warm", prompts, workload.per_pass)
    block_bytes = _block_bytes(run)
    save = _measure(run, cold, SAVE_HOOKS, [len(p) // tokens_per_block for p in prompts])
    delivered = [math.ceil((run.outcomes[rid].first_computed or 0) / tokens_per_block) for rid in warm.ids]
    load = _measure(run, warm, LOAD_HOOKS, delivered)
    return VllmBlockSize(block_bytes, save, load, _issue(run, cold, warm))


@dataclass(frozen=True)
class _Round:
    ids: list[str]
    first_step: int
    end_step: int
    seconds: float


def _engine(target: ConnectorTarget, model: str, tpb: int, workload: Workload, folder: Path,
            prompt_len: int) -> VllmRun:
    per_pass = min(workload.per_pass, workload.prompts)
    blocks = per_pass * (math.ceil(prompt_len / tpb) + 2) + 2
    shape = EngineShape(block_size=tpb, num_blocks=blocks, max_num_batched_tokens=per_pass * (prompt_len + 1),
                        max_num_seqs=per_pass, max_model_len=tpb * (blocks - 1), prefix_caching=False)
    built = build_engine(VllmModel.of(load_model(model)), shape, target.in_folder(folder), folder / "engine")
    return VllmRun(built)


def _round(run: VllmRun, label: str, prompts: list[list[int]], per_pass: int) -> _Round:
    """Every prompt to its end, `per_pass` at a time, one new token each."""
    ids = [f"{label}-{i}" for i in range(len(prompts))]
    first, started = len(run.steps), time.perf_counter()
    for at in range(0, len(prompts), per_pass):
        for rid, prompt in zip(ids[at:at + per_pass], prompts[at:at + per_pass], strict=True):
            run.add(rid, prompt, max_tokens=1)
        run.run()
    return _Round(ids, first, len(run.steps), time.perf_counter() - started)


def _measure(run: VllmRun, round_: _Round, hooks: tuple[str, ...], blocks: list[int]) -> Measured:
    spans = [s for s in run.hooks.spans if round_.first_step <= s.step < round_.end_step]
    timed = [(s.start, s.end) for s in spans if s.hook in hooks]
    steps_of = {rid: {r.index for r in run.steps[round_.first_step:round_.end_step] if rid in r.num_scheduled}
                for rid in round_.ids}
    latencies = [_seconds(union([(s.start, s.end) for s in spans if s.hook in hooks and s.step in steps_of[rid]]))
                 for rid, moved in zip(round_.ids, blocks, strict=True) if moved]
    inside = sum(s.end - s.start for s in spans)
    return Measured(sum(blocks), _seconds(union(timed)), latencies, inside, round_.seconds)


def _seconds(spans: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in spans)


def _block_bytes(run: VllmRun) -> int:
    """Bytes of one block over every layer of every worker's KV cache tensors."""
    return sum(t[0].numel() * t.element_size() for worker in run.workers for t in worker.tensors.values())


def _issue(run: VllmRun, cold: _Round, warm: _Round) -> str | None:
    if run.integrity.num_wrong:
        first = run.integrity.issues[0].describe() if run.integrity.issues else ""
        return f"{run.integrity.num_wrong} token-layer reads differ from a full recompute ({first})"
    differ = [c for c, w in zip(cold.ids, warm.ids, strict=True) if run.tokens(c)[-1:] != run.tokens(w)[-1:]]
    if differ:
        return f"{len(differ)} of {len(cold.ids)} warm prompts generated other tokens than cold"
    return None

