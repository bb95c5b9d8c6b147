"""A vLLM engine core's loop with kvtool playing the model: vLLM's own `Scheduler` decides, kvtool's
workers run each step, and `update_from_output` takes their `ModelRunnerOutput` back.

A step (vLLM 0.32.0's `EngineCore.step`): free, uncached blocks are poisoned (bytes nobody may
read); `schedule()`; the worker block tables updated; every worker's step (`worker.VllmWorker`);
with several workers their outputs aggregated by vLLM's `KVOutputAggregator` (an id is finished
once every worker reported it); one sampled token for every request whose known tokens are all
computed; `update_from_output`; then every running request's attended positions checked in every
worker's tensors (a connector writing where it must not is caught at the step it did).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtool.engine.fingerprint import PrefixHashes, sample_token
from kvtool.vllm_compat.block_tables import BlockTables, Scheduled
from kvtool.vllm_compat.engine_setup import BuiltEngine
from kvtool.vllm_compat.fingerprints import MAX_ISSUES, ByteIssue
from kvtool.vllm_compat.hook_log import HookLog
from kvtool.vllm_compat.model_config import VOCAB_SIZE
from kvtool.vllm_compat.step_record import Outcome, StepRecord, record_step
from kvtool.vllm_compat.worker import StepResult, VllmWorker


@dataclass
class Integrity:
    """What the fake forward's reads found wrong, over a run."""

    num_wrong: int = 0
    issues: list[ByteIssue] = field(default_factory=list)
    num_discarded: int = 0
    """Wrong reads of a step whose work vLLM threw away (a load failure reported in that step:
    the request recomputes from the failed block, or fails): nothing was served from them."""

    def add(self, result: StepResult, discarded: frozenset[str] = frozenset()) -> None:
        self.num_wrong += sum(n for rid, n in result.wrong.items() if rid not in discarded)
        self.num_discarded += sum(n for rid, n in result.wrong.items() if rid in discarded)
        kept = [issue for issue in result.issues if issue.request_id not in discarded]
        self.issues += kept[:max(0, MAX_ISSUES - len(self.issues))]


class VllmRun:
    """One engine: vLLM's scheduler over kvtool's workers, requests added and stepped by a scenario."""

    def __init__(self, built: BuiltEngine, seed: int = 0) -> None:
        self.built = built
        self.scheduler = built.scheduler
        self.hooks = HookLog()
        self.workers = [VllmWorker(built, rank, self.hooks) for rank in range(built.shape.num_workers)]
        self.tables = BlockTables()
        self.integrity = Integrity()
        self.steps: list[StepRecord] = []
        self.outcomes: dict[str, Outcome] = {}
        self._seed = seed
        self._tokens: dict[str, list[int]] = {}
        self._hashes: dict[str, PrefixHashes] = {}
        self._aggregator = _aggregator(self.workers)
        self._sampled: set[str] = set()
        self.observers: list[Callable[[Any, list[Scheduled]], None]] = []
        """Called with each step's `SchedulerOutput` and the requests it scheduled (a recorder)."""

    @property
    def connector(self) -> Any:
        """The connector's scheduler side (vLLM's scheduler built it)."""
        return self.scheduler.connector

    def add(self, request_id: str, prompt: list[int], max_tokens: int = 2, cache_salt: str | None = None,
            kv_transfer_params: dict | None = None) -> Any:
        """A request as vLLM's engine core makes one (its block hasher attached), added to the scheduler."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        request = Request(request_id=request_id, prompt_token_ids=list(prompt), cache_salt=cache_salt,
                          sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                          pooling_params=None, block_hasher=self.built.block_hasher)
        if kv_transfer_params is not None:
            request.kv_transfer_params = kv_transfer_params
        self._tokens[request_id] = list(prompt)
        self._hashes[request_id] = PrefixHashes(self._seed)
        self.outcomes[request_id] = Outcome(request_id, len(prompt))
        self.scheduler.add_request(request)
        return request

    def tokens(self, request_id: str) -> list[int]:
        """The request's tokens so far: its prompt and what the fake forward sampled."""
        return list(self._tokens[request_id])

    def abort(self, *request_ids: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def run(self, max_steps: int = 200) -> None:
        """Step until the scheduler holds nothing (vLLM's `has_requests`), at most `max_steps`."""
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                return
            self.step()

    def step(self) -> StepRecord:
        self.hooks.step = len(self.steps)
        self._poison_free_blocks()
        output = self.scheduler.schedule()
        scheduled = self.tables.update(output)
        for observe in self.observers:
            observe(output, scheduled)
        hashes = {s.request_id: self._hash_array(s.request_id, s.end) for s in scheduled}
        results = [worker.step(output, scheduled, hashes) for worker in self.workers]
        runner_output = self._runner_output(output, scheduled, results)
        engine_outputs = self.scheduler.update_from_output(output, runner_output)
        record = record_step(len(self.steps), output, runner_output.kv_connector_output, engine_outputs,
                             self.outcomes)
        discarded = self._discarded(scheduled)
        for result in results:
            self.integrity.add(result, discarded)
        self._forget_samples(discarded)
        self.steps.append(record)
        self._check_running(record.invalid_block_ids)
        return record

    def _discarded(self, scheduled: list[Scheduled]) -> frozenset[str]:
        """Requests whose step vLLM threw away: rolled back below the step's end, or failed."""
        requests = self.scheduler.requests
        return frozenset(s.request_id for s in scheduled
                         if (s.request_id in requests and requests[s.request_id].num_computed_tokens < s.end)
                         or self.outcomes[s.request_id].finish_reason == "error")

    def _forget_samples(self, discarded: frozenset[str]) -> None:
        """vLLM skips a discarded request's sampled token: so does the driver's record of its tokens."""
        for rid in discarded & self._sampled:
            self._tokens[rid].pop()
            self._hashes[rid].truncate(len(self._tokens[rid]))
        self._sampled.clear()

    def _runner_output(self, output: Any, scheduled: list[Scheduled], results: list[StepResult]) -> Any:
        from vllm.v1.outputs import ModelRunnerOutput

        if not output.total_num_scheduled_tokens:
            per_worker = [ModelRunnerOutput.with_kv_conn_output_only(r.output) for r in results]
        else:
            sampled = [self._sample(s) for s in scheduled]
            ids = [s.request_id for s in scheduled]
            per_worker = [ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                            sampled_token_ids=sampled, kv_connector_output=r.output)
                          for r in results]
        if self._aggregator is None:
            return per_worker[0]
        # The executor's aggregation (once a step: it counts each id's reports across steps).
        return self._aggregator.aggregate(per_worker, output_rank=0) or per_worker[0]

    def _sample(self, s: Scheduled) -> list[int]:
        """One token when every known token is computed (a prefill chunk short of the end samples none)."""
        tokens = self._tokens[s.request_id]
        if s.end < len(tokens):
            return []
        token = sample_token(int(self._hash_array(s.request_id, s.end)[s.end - 1]), 0, VOCAB_SIZE)
        tokens.append(token)
        self._sampled.add(s.request_id)
        return [token]

    def _hash_array(self, request_id: str, length: int) -> np.ndarray:
        hashes = self._hashes[request_id]
        hashes.extend_to(self._tokens[request_id][:length])
        return hashes.array()

    def _poison_free_blocks(self) -> None:
        """Blocks no request holds and vLLM's prefix cache does not know (never the null block)."""
        pool = self.scheduler.kv_cache_manager.block_pool
        free = [b.block_id for b in pool.blocks if b.ref_cnt == 0 and b.block_hash is None and not b.is_null]
        for worker in self.workers:
            worker.pages.poison(free)

    def _check_running(self, pending: frozenset[int]) -> None:
        for request in self.scheduler.running:
            rid = request.request_id
            if rid not in self.tables or not request.num_computed_tokens:
                continue
            hashes = self._hash_array(rid, request.num_computed_tokens)
            for worker in self.workers:
                self.integrity.add(worker.check_live(rid, self.tables.blocks(rid), hashes,
                                                     request.num_computed_tokens, pending))


def _aggregator(workers: list[VllmWorker]) -> Any:
    if len(workers) == 1:
        return None
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

    return KVOutputAggregator.from_connector(workers[0].connector, len(workers))
