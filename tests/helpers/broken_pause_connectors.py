"""Connectors that mishandle a paused request (TensorRT-LLM's MAX_UTILIZATION pause), built on the
shipped example connector: each saves blocks from page indices of the allocation that was taken
back (another request's KV, or poison) under the paused request's keys; `pause-replay` catches it.

Target: `tests/helpers/broken_pause_connectors.py:KeepsPagesAcrossPause:DictConnectorWorker`.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from dict_connector import DictConnectorScheduler, DictConnectorWorker  # noqa: E402

__all__ = ["DictConnectorWorker", "KeepsPagesAcrossPause"]


class KeepsPagesAcrossPause(DictConnectorScheduler):
    """Takes the early `request_finished` of a paused request for nothing to act on, then reads the
    replay's report (its tokens) but keeps the page indices it had before the pause."""

    def request_finished_by_layer_group(self, request, cache_block_ids_by_layer_group):
        if not request.is_finished:      # taken for an abort it need not act on: the request is kept
            return False
        return super().request_finished_by_layer_group(request, cache_block_ids_by_layer_group)

    def _completed(self, data, is_new):
        tracked = self._requests.get(data.request_id)
        if is_new and tracked is not None and tracked.pages:
            tracked.tokens = []
            return super()._completed(replace(data, new_block_ids_by_layer_group=[[] for _ in tracked.pages]), False)
        return super()._completed(data, is_new)
