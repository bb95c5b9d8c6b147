"""A connector that mishandles draft tokens, built on the shipped example: it saves a block in the
verify pass whose 1 + K scheduled tokens would complete it (staged under the request and block
ordinal) and publishes it under the block's key once the tokens arrive, but the pass wrote rejected
drafts' KV there. `draft-tokens` catches it.

Target: `tests/helpers/broken_draft_connectors.py:SavesWhatDraftsWouldComplete:StagingWorker`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from dict_connector import DictConnectorScheduler, DictConnectorWorker, block_keys  # noqa: E402


class SavesWhatDraftsWouldComplete(DictConnectorScheduler):
    def __init__(self, llm_args) -> None:
        super().__init__(llm_args)
        self._staged: dict[tuple[int, int], list[tuple[int, int]]] = {}   # (request, block) -> (group, page)
        self._stage, self._publish, self._published = [], [], []

    def _completed(self, data, is_new):
        saves = super()._completed(data, is_new)
        tracked = self._requests.get(data.request_id)
        if is_new or tracked is None or data.num_scheduled_tokens == 1:
            return saves
        tpb = self.tokens_per_block
        would_complete = (data.computed_position + data.num_scheduled_tokens) // tpb
        for j in range(tracked.next_block, would_complete):
            slots = [(g, pages[j]) for g, pages in enumerate(tracked.pages) if j < len(pages) and pages[j] >= 0]
            self._staged[(data.request_id, j)] = slots
            self._stage += [(data.request_id, j, g, page) for g, page in slots]
        tracked.next_block = max(tracked.next_block, would_complete)
        return saves

    def build_connector_meta(self, scheduler_output):
        for key, group in self._published:
            self._stored.setdefault(key, set()).add(group)
        self._published = []
        meta = super().build_connector_meta(scheduler_output)
        for (rid, j), slots in list(self._staged.items()):
            tracked = self._requests.get(rid)
            keys = block_keys(tracked.salt, tracked.tokens, self.tokens_per_block) if tracked else []
            if j < len(keys):
                self._publish += [(rid, j, g, keys[j]) for g, _ in slots]
                self._published += [(keys[j], g) for g, _ in slots]
                del self._staged[(rid, j)]
        meta.stage, meta.publish, self._stage, self._publish = self._stage, self._publish, [], []
        return meta


class StagingWorker(DictConnectorWorker):
    def __init__(self, llm_args) -> None:
        super().__init__(llm_args)
        self._staging: dict[tuple, list] = {}

    def start_load_kv(self, stream):
        for rid, j, group, key in getattr(self._metadata, "publish", []):
            self._blocks[(key, group)] = self._staging.pop((rid, j, group))
        super().start_load_kv(stream)

    def wait_for_save(self, stream):
        super().wait_for_save(stream)
        for rid, j, group, page in getattr(self._metadata, "stage", []):
            self._staging[(rid, j, group)] = [r.slot_tensor(page).to("cpu", copy=True) for r in self._regions[group]]
