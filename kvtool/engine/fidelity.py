"""Fidelity: how much of the KV a run really moves. `bytes`: pools hold KV bytes the fake engine
writes and verifies; `blocks`: virtual pools, nothing written (`no_bytes`); `tokens`: the tokens
`bytes` would generate, nothing written (`token_model`), for a reference run."""

from __future__ import annotations

from dataclasses import replace

from kvtool.connector.loader import ConnectorSpec
from kvtool.engine.engine_config import EngineConfig
from kvtool.engine.fake_engine import FakeEngine
from kvtool.engine.no_bytes import NoBytesModel
from kvtool.engine.pass_types import KvBytesModel
from kvtool.engine.token_model import ReferenceTokens
from kvtool.errors import InputError
from kvtool.manager.config import KvCacheManagerConfig
from kvtool.manager.manager import KvCacheManager
from kvtool.types import Fidelity


def parse_fidelity(text: str) -> Fidelity:
    """The fidelity a user named (InputError for any other text)."""
    try:
        return Fidelity(text)
    except ValueError:
        raise InputError(f"unknown fidelity {text!r}: bytes or blocks (tokens: reference runs only)") from None


def pools_for(fidelity: Fidelity, config: KvCacheManagerConfig) -> KvCacheManagerConfig:
    """The manager's config at `fidelity`: block fidelity's pools are virtual (nothing allocated,
    nothing poisoned)."""
    return replace(config, virtual=True, poison_new_pages=False) if fidelity == Fidelity.BLOCKS else config


def bytes_model(fidelity: Fidelity, manager: KvCacheManager, seed: int, model_heads: int) -> KvBytesModel:
    """What writes and checks the pages' bytes at `fidelity` (`require_fidelity` has passed)."""
    fidelity = Fidelity(fidelity)
    if fidelity is Fidelity.BLOCKS:
        return NoBytesModel(manager.layer_groups)
    model = ReferenceTokens if fidelity is Fidelity.TOKENS else FakeEngine
    return model(manager.layout, manager.layer_groups, seed, model_heads=model_heads)


def require_fidelity(config: EngineConfig, connector: ConnectorSpec | None) -> None:
    """InputError for a fidelity this engine cannot run, or one the connector does not fit."""
    parse_fidelity(config.fidelity)
    if config.fidelity == Fidelity.TOKENS and (connector is not None or config.num_ranks != 1):
        raise InputError("token fidelity is for a reference run: one rank and no connector")
    moves_bytes = connector is None or getattr(connector.scheduler_class, "kvtool_moves_bytes", True)
    if config.fidelity == Fidelity.BLOCKS:
        if config.num_ranks != 1 or config.process_group_of_one:
            raise InputError("block fidelity runs one rank: drop --num-ranks (or use --fidelity bytes)")
        if connector is not None and moves_bytes:
            raise InputError(f"connector {connector.name!r} moves KV bytes, and block fidelity has none: "
                             "use --connector index, redis-index or mooncake-index (tiers that only index) "
                             "or --fidelity bytes")
    elif connector is not None and not moves_bytes:   # (no connector: moves_bytes)
        raise InputError(f"connector {connector.name!r} moves no bytes (it stands in for a tier in block "
                         "fidelity): use it with --fidelity blocks")
