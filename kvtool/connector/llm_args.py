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
    """Window per layer (None: full attention)."""
    sink_token_length: int = 0
    host_cache_size: int = 0
    disk_cache_size: int = 0


@dataclass(frozen=True)
class KvCacheConnectorConfig:
    connector_module: str = ""
    connector_scheduler_class: str = ""
    connector_worker_class: str = ""


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
