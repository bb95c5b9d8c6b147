"""Mooncake-format traces for tests, and the reuse they allow, computed from the ids alone."""

from __future__ import annotations

import json
import random
from pathlib import Path


def random_mooncake_trace(path: Path, num_requests: int, block_size: int, seed: int = 0,
                          max_blocks: int = 6) -> list[dict]:
    """Write `num_requests` records whose prompts extend random earlier prompts (a tree of ids, the
    way conversations and shared system prompts look in the published trace); return them."""
    rng = random.Random(seed)
    records, next_id = [], 0
    for i in range(num_requests):
        ids: list[int] = []
        if records and rng.random() < 0.7:
            parent = rng.choice(records)["hash_ids"]
            ids = parent[:rng.randint(1, len(parent))]
        for _ in range(rng.randint(0 if ids else 1, max_blocks - len(ids) if len(ids) < max_blocks else 0)):
            ids.append(next_id)
            next_id += 1
        if not ids:
            ids = [next_id]
            next_id += 1
        length = (len(ids) - 1) * block_size + rng.randint(1, block_size)
        records.append({"timestamp": i * 10, "input_length": length, "output_length": rng.randint(0, 5),
                        "hash_ids": ids})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def reusable_tokens(records: list[dict], block_size: int, tokens_per_block: int) -> list[int]:
    """Per request, the prompt tokens an unbounded cache of whole `tokens_per_block` blocks saved by
    the requests before it can serve: the common prefix with any earlier prompt (an id at position
    i covers min(length, (i + 1) * block_size) tokens of the prompt that had it), cut to whole
    blocks, and at most length - 1 (the last position is always computed)."""
    covered: dict[tuple[int, int], int] = {}
    hits = []
    for record in records:
        length, ids = record["input_length"], record["hash_ids"]
        common = 0
        for position, block_id in enumerate(ids):
            needed = min(length, (position + 1) * block_size)
            seen = covered.get((position, block_id), 0)
            common = max(common, min(seen, needed))
            if seen < needed:
                break
        whole = common // tokens_per_block * tokens_per_block
        hits.append(min(whole, length - 1))
        for position, block_id in enumerate(ids):
            key = (position, block_id)
            covered[key] = max(covered.get(key, 0), min(length, (position + 1) * block_size))
    return hits
