"""The TensorRT-LLM-style file connector (tests/data/trtllm_style_connector.py) reading its folder
from `CONNECTOR_CACHE_FOLDER` in its constructor, as TensorRT-LLM's file examples do (their own
`main` sets it). A folder the user set outlives every engine of a validate run; validate points the
variable at each engine's own folder (`kvtool.validate.user_store`). Run with `--compat trtllm`."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
from trtllm_style_connector import BlockFilesLeader, BlockFilesWorker  # noqa: E402,F401


class CacheFolderLeader(BlockFilesLeader):
    def __init__(self, llm_args):
        super().__init__(llm_args)
        self.folder = os.environ.get("CONNECTOR_CACHE_FOLDER", "./connector_cache")
        os.makedirs(self.folder, exist_ok=True)

    def _path(self, tokens):
        return os.path.join(self.folder, os.path.basename(super()._path(tokens)))
