"""The example dict connector with its store in module-level dicts instead of its objects: the store
outlives the engine. On one rank it serves the next engine of the same process what an earlier one
saved (correct bytes, by luck: same model, same fingerprints); with several ranks the follower
ranks' processes are new with every engine, their dicts empty, and their loads fail. `kvtool
validate` says so in words on one rank and on several (`judges.offers_from_elsewhere`)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from dict_connector import DictConnectorScheduler, DictConnectorWorker  # noqa: E402

STORED: dict[bytes, set[int]] = {}
"""Key -> layer groups holding it (the scheduler's index), for the life of the process."""
BLOCKS: dict[tuple, list] = {}
"""(key, layer group) -> the block's bytes per region (the worker's store), for the life of the process."""


class ModuleStoreScheduler(DictConnectorScheduler):
    def __init__(self, llm_args) -> None:
        super().__init__(llm_args)
        self._stored = STORED


class ModuleStoreWorker(DictConnectorWorker):
    def __init__(self, llm_args) -> None:
        super().__init__(llm_args)
        self._blocks = BLOCKS


def forget() -> None:
    """Empty the module's store (a test's fresh start)."""
    STORED.clear()
    BLOCKS.clear()
