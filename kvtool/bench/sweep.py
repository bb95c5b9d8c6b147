"""Which cases a bench run measures: the built-in default sweep, or the options' product."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import TypedDict

from kvtool.bench.transfer_suite import Case
from kvtool.bench.workspace import Direction


class SweepDefaults(TypedDict):
    models: dict[str, tuple[int, ...]]
    """Model preset: tokens per block swept."""
    batch_bytes: int
    repeats: int


GPU_DEFAULT: SweepDefaults = {"models": {"llama-3.1-8b": (4, 16, 64), "gpt-oss-20b": (8,), "deepseek-v3": (64,)},
                              "batch_bytes": 64 << 20, "repeats": 10}
CPU_DEFAULT: SweepDefaults = {"models": {"llama-3.1-8b": (4, 32), "gpt-oss-20b": (8,)}, "batch_bytes": 16 << 20,
                              "repeats": 5}
QUICK: SweepDefaults = {"models": {"llama-3.1-8b": (4,)}, "batch_bytes": 16 << 20, "repeats": 3}


@dataclass(frozen=True)
class SweepChoice:
    models: tuple[str, ...] | None
    tokens_per_block: tuple[int, ...] | None
    granularities: tuple[str, ...]
    directions: tuple[Direction, ...]
    backends: tuple[str, ...]
    batch_bytes: int | None
    repeats: int | None
    quick: bool


def plan(choice: SweepChoice, cuda: bool) -> tuple[list[Case], int]:
    """(cases, repeats). Models and block sizes not given come from the default sweep."""
    defaults = QUICK if choice.quick else GPU_DEFAULT if cuda else CPU_DEFAULT
    models = {m: defaults["models"].get(m, (16,)) for m in choice.models} if choice.models else defaults["models"]
    if choice.tokens_per_block:
        models = {m: choice.tokens_per_block for m in models}
    batch = choice.batch_bytes or defaults["batch_bytes"]
    cases = [Case(model, tpb, granularity, direction, backend, batch)
             for model, tpbs in models.items() for tpb in tpbs
             for granularity, direction, backend in product(choice.granularities, choice.directions, choice.backends)]
    return cases, choice.repeats or defaults["repeats"]

