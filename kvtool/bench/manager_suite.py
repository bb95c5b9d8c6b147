"""`--suite manager`: the manager's own CPU cost per block, at 1x, 10x and 100x cached blocks, so a
cost that grows with the size of the cache shows up."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from kvtool.blocks import ceil_div
from kvtool.manager import KvCacheManager, KvCacheManagerConfig
from kvtool.models import load_model

TOKENS_PER_BLOCK = 4
BLOCKS_PER_PROMPT = 64


@dataclass
class ManagerRow:
    operation: str
    cached_blocks: int
    blocks: int
    us_per_block: float
    ratio_to_1x: float

    def as_dict(self) -> dict:
        return asdict(self)


def run(base_blocks: int = 1000, scales: tuple[int, ...] = (1, 10, 100), samples: int = 20) -> list[ManagerRow]:
    """Microseconds per block of each operation on a manager already full of cached blocks."""
    rows: list[ManagerRow] = []
    baseline: dict[str, float] = {}
    for scale in scales:
        cached = base_blocks * scale
        for operation, us in _measure(cached, samples).items():
            baseline.setdefault(operation, us)
            rows.append(ManagerRow(operation, cached, samples * BLOCKS_PER_PROMPT, round(us, 3),
                                   round(us / baseline[operation], 3)))
    return rows


def _prompt(seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 2**31 for i in range(BLOCKS_PER_PROMPT * TOKENS_PER_BLOCK)]


def _measure(cached_blocks: int, samples: int) -> dict[str, float]:
    num_prompts = ceil_div(cached_blocks, BLOCKS_PER_PROMPT)
    slots = num_prompts * BLOCKS_PER_PROMPT     # full of cached blocks: every allocation evicts
    manager = KvCacheManager(KvCacheManagerConfig(load_model("tiny"), TOKENS_PER_BLOCK, num_slots=slots, device="cpu"))
    for p in range(num_prompts):
        _run_prompt(manager, p, _prompt(p)).close()
    totals = {"allocate (evicting)": 0.0, "commit": 0.0, "free": 0.0, "match": 0.0}
    for s in range(samples):
        fresh = _prompt(10**6 + s)
        start = time.perf_counter()
        cache = manager.create_kv_cache(("new", s), [])
        cache.resume()
        cache.resize(len(fresh))
        totals["allocate (evicting)"] += time.perf_counter() - start
        start = time.perf_counter()
        cache.commit(fresh)
        totals["commit"] += time.perf_counter() - start
        start = time.perf_counter()
        cache.close()
        totals["free"] += time.perf_counter() - start
        start = time.perf_counter()
        manager.create_kv_cache(("match", s), _prompt(num_prompts - 1 - s % num_prompts)).close()
        totals["match"] += time.perf_counter() - start
    return {op: seconds / (samples * BLOCKS_PER_PROMPT) * 1e6 for op, seconds in totals.items()}


def _run_prompt(manager: KvCacheManager, cache_id: int, tokens: list[int]):
    cache = manager.create_kv_cache(cache_id, [])
    cache.resume()
    cache.resize(len(tokens))
    cache.commit(tokens)
    return cache

