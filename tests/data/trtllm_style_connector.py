"""A connector written against TensorRT-LLM's connector module, the way a first file-based
connector is written for it: single-tensor registration, one file per block (torch.save), blocking
loads in start_load_kv and saves in wait_for_save. kvtool's tests run it, unchanged, under
`kvtool validate --compat trtllm`.

Its simplifications are deliberate (kvtool validate is expected to find them): the file name hashes
one block's tokens (no prefix chaining, no cache_salt), and pending loads are forgotten at every
iteration.
"""

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tensorrt_llm import LLM, logger  # noqa: F401  (LLM is what a real script would start)
from tensorrt_llm._torch.pyexecutor.kv_cache_connector import (
    KvCacheConnectorScheduler,
    KvCacheConnectorWorker,
    SchedulerOutput,
)
from tensorrt_llm.bindings.internal.batch_manager import LlmRequest
from tensorrt_llm.llmapi.llm_args import KvCacheConnectorConfig, TorchLlmArgs  # noqa: F401

FOLDER = os.environ.get("BLOCK_FILES_FOLDER", "./block_files")


@dataclass
class BlockFilesMetadata:
    load: list = field(default_factory=list)
    save: list = field(default_factory=list)


class BlockFilesWorker(KvCacheConnectorWorker):
    def __init__(self, llm_args: TorchLlmArgs):
        super().__init__(llm_args)
        self.kv_cache_tensor = None

    def register_kv_caches(self, kv_cache_tensor: torch.Tensor):
        self.kv_cache_tensor = kv_cache_tensor

    def start_load_kv(self, stream):
        for path, block_id in self._metadata.load:
            self.kv_cache_tensor[block_id].copy_(torch.load(path, map_location="cpu"))

    def wait_for_layer_load(self, layer_idx, stream):
        pass

    def save_kv_layer(self, layer_idx, stream):
        pass

    def wait_for_save(self, stream):
        stream.synchronize()
        for path, block_id in self._metadata.save:
            if not Path(path).exists():
                torch.save(self.kv_cache_tensor[block_id].cpu().clone(), path)

    def get_finished(self, finished_gen_req_ids, started_loading_req_ids):
        return [], []


class BlockFilesLeader(KvCacheConnectorScheduler):
    def __init__(self, llm_args: TorchLlmArgs):
        super().__init__(llm_args)
        self.block_size = self._llm_args.kv_cache_config.tokens_per_block
        self.pending = {}
        os.makedirs(FOLDER, exist_ok=True)

    def _path(self, tokens):
        return os.path.join(FOLDER, hashlib.sha256(repr(list(tokens)).encode()).hexdigest() + ".pt")

    def _blocks(self, tokens):
        return [tokens[i:i + self.block_size] for i in range(0, len(tokens), self.block_size)]

    def get_num_new_matched_tokens(self, request: LlmRequest, num_computed_tokens: int):
        self.pending[request.request_id] = []
        if num_computed_tokens % self.block_size:
            return 0, False
        for block in self._blocks(request.get_tokens(0)[num_computed_tokens:]):
            if len(block) < self.block_size or not Path(self._path(block)).exists():
                break
            self.pending[request.request_id].append(self._path(block))
        logger.info(f"matched {len(self.pending[request.request_id])} blocks for request {request.request_id}")
        return len(self.pending[request.request_id]) * self.block_size, False

    def update_state_after_alloc(self, request, block_ids):
        pass

    def build_connector_meta(self, scheduler_output: SchedulerOutput):
        meta = BlockFilesMetadata()
        for req in scheduler_output.new_requests:
            first = req.computed_position // self.block_size
            loads = self.pending.get(req.request_id, [])
            meta.load += [(path, req.new_block_ids[first + i]) for i, path in enumerate(loads)]
            blocks = self._blocks(req.new_tokens)
            for pos in range(first + len(loads), len(req.new_block_ids)):
                if len(blocks[pos]) == self.block_size:
                    meta.save.append((self._path(blocks[pos]), req.new_block_ids[pos]))
        self.pending = {}
        return meta

    def request_finished(self, request, cache_block_ids):
        return False
