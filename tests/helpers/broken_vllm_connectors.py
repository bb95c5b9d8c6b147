"""vLLM connectors with one planted bug each, the shapes vLLM's users reported: kvtool-host with
one method wrong. Each names the scenario that must fail it (`FAILS`), at the default seed."""

from __future__ import annotations

from typing import Any

from kvtool.vllm_compat.block_tables import BlockTables
from kvtool.vllm_compat.host_connector import HostMetadata, KvtoolHostConnector, Transfer


class ShiftedLoad(KvtoolHostConnector):
    """Loads each stored block into the next block of the request (an off-by-one in the block list)."""

    def load(self, transfer: Transfer, asynchronous: bool) -> None:
        targets = [blocks for blocks, _ in transfer.blocks]
        hashes = [h for _, h in transfer.blocks]
        rotated = tuple(zip(targets[1:] + targets[:1], hashes, strict=True))
        super().load(Transfer(transfer.request_id, rotated), asynchronous)


class EarlyRecv(KvtoolHostConnector):
    """Reports an asynchronous load finished when it starts, and copies it a step later."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HostMetadata)
        for transfer in getattr(self, "later", []):
            self.load(transfer, True)
        self.later = list(meta.loads)
        self.recved |= meta.async_loads


class AskSideEffects(EarlyRecv):
    """Starts an asynchronous load at the ask (a side effect): an ask vLLM repeats because the
    allocation failed has its load reported finished before vLLM ever parked the request, so the
    real load, done a step later (EarlyRecv's copy), lands after vLLM already scheduled the request."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        count, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if count:
            self.meta.async_loads.add(request.request_id)
        return count, is_async


class SilentLoadFailure(KvtoolHostConnector):
    """A failed block left unloaded and never reported: vLLM serves whatever the block held."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        self.load_errors = set()
        return set()

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = super().get_transfer_results(finished_req_ids)
        results.failed_recving = set()
        return results


class LateErrorReport(KvtoolHostConnector):
    """Reports a failed block one step late (#49250's shape: the block, shared by two requests,
    is read before vLLM knows to recompute it)."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        now, self.late = getattr(self, "late", set()), set(self.load_errors)
        self.load_errors = set()
        return now


class _AppendingTables(BlockTables):
    def _drop(self, output: Any) -> None:
        for request_id in output.finished_req_ids:
            self._tables.pop(request_id, None)

    def _apply_cached(self, request_id: str, new_block_ids: Any, resumed: bool) -> None:
        super()._apply_cached(request_id, new_block_ids, resumed=False)


class AppendsResumedBlocks(KvtoolHostConnector):
    """Appends a resumed request's new block list to its old one (#29870, #32398: the connector's
    view of a preempted and re-admitted request is stale), so its later saves read freed blocks."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tables = _AppendingTables()


class SendBeforeSaved(KvtoolHostConnector):
    """Reports a delayed save finished at once and copies it a step later, from freed blocks."""

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HostMetadata)
        for transfer in getattr(self, "later", []):
            self.save(transfer)
        self.later = [t for t in meta.saves if t.request_id in meta.async_saves]
        for transfer in meta.saves:
            if transfer.request_id not in meta.async_saves:
                self.save(transfer)
        self.sent |= meta.async_saves


class SkipsEmptySteps(KvtoolHostConnector):
    """Does its save work only on steps with a forward (#41945): a delayed save whose step is
    empty is never done nor reported, and its blocks are held for ever."""

    def wait_for_save(self) -> None:
        from vllm.forward_context import get_forward_context

        if get_forward_context().attn_metadata is None:
            return
        super().wait_for_save()


class FlattensGroups(KvtoolHostConnector):
    """Moves every KV cache group's bytes with the first group's block ids."""

    def copy_block(self, blocks: tuple[int, ...], block_hash: bytes, into_pages: bool) -> None:
        super().copy_block(tuple(blocks[0] for _ in blocks), block_hash, into_pages)


FAILS = {
    "ShiftedLoad": ("cold-warm", "tiny", "integrity"),
    "AskSideEffects": ("ask-again", "tiny", "scenario"),
    "EarlyRecv": ("async-load", "tiny", "integrity"),
    "SilentLoadFailure": ("load-error-recompute", "tiny", "integrity"),
    "LateErrorReport": ("load-error-recompute", "tiny", "integrity"),
    "AppendsResumedBlocks": ("preemption", "tiny", "integrity"),
    "SendBeforeSaved": ("delay-free", "tiny", "integrity"),
    "SkipsEmptySteps": ("empty-step", "tiny", "holds-nothing"),
    "FlattensGroups": ("hybrid", "tiny-vswa", "integrity"),
}
"""Each planted connector: the scenario, model and check that fail it."""


class NeverHits(KvtoolHostConnector):
    """Saves, and never reports a hit: a store bench's warm round loads nothing."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False
