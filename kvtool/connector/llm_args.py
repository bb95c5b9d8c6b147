"""The runtime-arguments object both connector halves are constructed with.

It keeps the reference runtime's shape (`llm_args.kv_cache_config.tokens_per_block`,
`llm_args.kv_connector_config`) so its connectors port unchanged, and adds what a connector needs
to know about layer groups before the first request (the worker learns the rest from the layout).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtool.blocks import stale_block_range


@dataclass(frozen=True)
class LayerGroupInfo:
    layer_group_id: int
    layer_ids: tuple[int, ...]
    window_size: int | None
    num_sink_tokens: int
    bytes_per_page: int

    def stale_range(self, history_length: int, tokens_per_block: int) -> range:
        """Blocks with no page at this history: the manager's rule, `kvtool.blocks.stale_block_range`."""
        return stale_block_range(history_length, tokens_per_block, self.window_size, self.num_sink_tokens)


@dataclass(frozen=True)
class KvCacheConfig:
    tokens_per_block: int
    max_attention_window: tuple[int | None, ...] = ()
    """Window per layer (None: full attention; TensorRT-LLM normalises a window of at least
    max_seq_len to None too)."""
    sink_token_length: int = 0
    host_cache_size: int = 0
    disk_cache_size: int = 0
    enable_block_reuse: bool = True
    use_kv_cache_manager_v2: bool = True


@dataclass(frozen=True)
class Mapping:
    """What `parallel_config.to_mapping()` gives a connector: where this rank sits. kvtool runs
    tensor parallelism only (no pipeline, context or attention-data parallelism)."""

    world_size: int = 1
    rank: int = 0
    tp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1
    enable_attention_dp: bool = False

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return 0


@dataclass(frozen=True)
class ParallelConfig:
    """`llm_args.parallel_config` (TensorRT-LLM's `_ParallelConfig`, the fields kvtool models)."""

    tp_size: int = 1
    rank: int = 0
    num_ranks: int = 1
    """Every rank kvtool runs: the TP shards, or (tp 1) replicas that each hold the whole cache."""
    pp_size: int = 1
    cp_size: int = 1
    enable_attention_dp: bool = False

    @property
    def world_size(self) -> int:
        return self.num_ranks

    @property
    def is_multi_gpu(self) -> bool:
        return self.world_size > 1

    def to_mapping(self) -> Mapping:
        return Mapping(self.world_size, self.rank, self.tp_size, self.pp_size, self.cp_size, self.enable_attention_dp)


@dataclass(frozen=True)
class KvCacheConnectorConfig:
    connector_module: str = ""
    connector_scheduler_class: str = ""
    connector_worker_class: str = ""
    connector: str | None = None
    """TensorRT-LLM's preset name (`lmcache`, `kvbm`): kvtool names the classes directly."""
    server_url: str | None = None
    """TensorRT-LLM's URL of a connector's out-of-process server (LMCache's multi-process mode reads
    it); set it with `--connector-opt server_url=URL`."""


@dataclass(frozen=True)
class LlmArgs:
    model: str
    kv_cache_config: KvCacheConfig
    kv_connector_config: KvCacheConnectorConfig = KvCacheConnectorConfig()
    layer_groups: tuple[LayerGroupInfo, ...] = ()
    dtype: str = "bf16"
    max_seq_len: int | None = None
    connector_options: dict[str, str] = field(default_factory=dict)
    """Options for kvtool's built-in connectors (for example `dir`, `capacity`)."""
    rank: int = 0
    world_size: int = 1
    tensor_parallel_size: int = 1
    """Ranks sharding the KV heads (`--tp`); 1 where ranks replicate the whole cache."""
    enable_attention_dp: bool = False
    pipeline_parallel_size: int = 1

    @property
    def parallel_config(self) -> ParallelConfig:
        """This rank's place, as TensorRT-LLM's `llm_args.parallel_config`: kvtool's ranks are
        tensor-parallel shards (`--tp N`), or replicas that each hold the whole cache (tp 1)."""
        return ParallelConfig(tp_size=self.tensor_parallel_size, rank=self.rank, num_ranks=self.world_size)
