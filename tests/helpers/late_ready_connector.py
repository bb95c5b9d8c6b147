"""A host connector whose scheduler finishes its setup READY_S after it is constructed and raises
on an ask before then, as NVIDIA Dynamo KVBM 1.6.1's leader does ("slot_manager not initialized":
it builds its slot manager in the background once its workers have registered): for the tests of
`EngineConfig.warmup_seconds` and `kvtool validate --warmup`."""

from __future__ import annotations

import time

from kvtool.connectors.host import HostConnectorScheduler, HostConnectorWorker

READY_S = 0.3


class LateReady(HostConnectorScheduler):
    def __init__(self, llm_args) -> None:
        super().__init__(llm_args)
        self._ready_at = time.monotonic() + READY_S

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if time.monotonic() < self._ready_at:
            raise RuntimeError("slot manager not initialized")
        return super().get_num_new_matched_tokens(request, num_computed_tokens)


Worker = HostConnectorWorker
