"""Synthetic workloads of the shapes no one publishes, as kvtool JSON Lines.

- `chat`: conversations that share one system prompt; turn k's prompt is the system prompt, every
  earlier user message and reply, and a new user message (so turn k reuses turn k-1's prompt).
- `docqa`: questions over a fixed set of documents, picked by a Zipf law (a few documents get most
  questions): the system prompt, the document, a question.
- `agentic`: tool loops: each step's prompt is the previous step's prompt, the model's call and
  the tool's output, so a session's prompt grows step by step.

Sessions (conversations, agent runs) start as a Poisson process at `rate` per second; the turns
of one are `think_seconds` apart. Replies in a later prompt are fresh tokens, not the engine's
own generated ones (a real engine re-tokenizes them; kvtool's fake model samples placeholders),
so reuse spans prompts, as in the published traces. Everything is a pure function of the seed,
and requests are written in arrival order without holding the prompts of more than one.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

import numpy as np

from kvtool.blocks import ceil_div
from kvtool.errors import InputError

KINDS = ("chat", "docqa", "agentic")
VOCAB = 32_000


@dataclass(frozen=True)
class GeneratorConfig:
    kind: str
    num_requests: int = 1000
    seed: int = 0
    rate: float = 2.0
    """Sessions started per second (Poisson)."""
    think_seconds: float = 5.0
    """Between two turns of one session."""
    prefix_tokens: int = 2048
    """The system prompt (chat, agentic) or a document's length (docqa)."""
    turn_tokens: int = 256
    """A user message (chat), a question (docqa), a tool's output (agentic)."""
    output_tokens: int = 128
    """Tokens each request generates (and each reply in a later prompt)."""
    turns: int = 6
    """Turns of a conversation or steps of an agent run (docqa: 1)."""
    documents: int = 50
    """Distinct documents (docqa)."""
    zipf: float = 1.1
    """Exponent of the documents' popularity (docqa)."""

    def check(self) -> None:
        """InputError for a kind not known or a knob out of range."""
        if self.kind not in KINDS:
            raise InputError(f"unknown workload kind {self.kind!r}; known: {', '.join(KINDS)}")
        for name, option in (("num_requests", "--requests"), ("prefix_tokens", "--prefix-tokens"),
                             ("turn_tokens", "--turn-tokens"), ("turns", "--turns"), ("documents", "--documents")):
            if getattr(self, name) < 1:
                raise InputError(f"{option} must be >= 1, got {getattr(self, name)}")
        if self.output_tokens < 0:
            raise InputError(f"--output-tokens must be >= 0, got {self.output_tokens}")
        if not self.rate > 0 or not self.think_seconds >= 0 or not self.zipf > 0:
            raise InputError("--rate and --zipf must be > 0 and --think-seconds >= 0")


def write_workload(config: GeneratorConfig, handle: IO[str]) -> int:
    """Write the workload's lines to `handle`; the number of requests."""
    config.check()
    count = 0
    for request_id, (arrival, prompt) in enumerate(generate(config)):
        handle.write(json.dumps({"request_id": request_id, "prompt": prompt, "max_new_tokens": config.output_tokens,
                                 "arrival": round(arrival, 6)}) + "\n")
        count += 1
    return count


def generate(config: GeneratorConfig) -> Iterator[tuple[float, list[int]]]:
    """(arrival seconds, prompt token ids) of each request, in arrival order."""
    rng = np.random.default_rng([config.seed, 0])
    turns = 1 if config.kind == "docqa" else config.turns
    starts = np.cumsum(rng.exponential(1.0 / config.rate, size=ceil_div(config.num_requests, turns) + 1))
    # (arrival, session, turn) of every request, merged in arrival order across sessions
    pending = [(float(start), session, 0) for session, start in enumerate(starts)]
    heapq.heapify(pending)
    system = _tokens(config.seed, "system", config.prefix_tokens)
    for _ in range(config.num_requests):
        arrival, session, turn = heapq.heappop(pending)
        if turn + 1 < turns:
            heapq.heappush(pending, (arrival + config.think_seconds, session, turn + 1))
        yield arrival, _prompt(config, system, session, turn)


def _prompt(config: GeneratorConfig, system: list[int], session: int, turn: int) -> list[int]:
    if config.kind == "docqa":
        document = _zipf_pick(config, session)
        return (system[:256] + _tokens(config.seed, f"document {document}", config.prefix_tokens)
                + _tokens(config.seed, f"question {session}", config.turn_tokens))
    prompt = list(system)
    for k in range(turn + 1):
        prompt += _tokens(config.seed, f"{config.kind} {session} turn {k}", config.turn_tokens)
        if k < turn:
            prompt += _tokens(config.seed, f"{config.kind} {session} reply {k}", max(config.output_tokens, 1))
    return prompt


def _zipf_pick(config: GeneratorConfig, question: int) -> int:
    rng = np.random.default_rng([config.seed, 1, question])
    return int(rng.choice(config.documents, p=_popularity(config.documents, config.zipf)))


@functools.lru_cache(maxsize=8)
def _popularity(documents: int, zipf: float) -> np.ndarray:
    """The chance of each document, rank 1 first (computed once, not per question)."""
    weights = np.arange(1, documents + 1, dtype=float) ** -zipf
    return weights / weights.sum()


def _tokens(seed: int, name: str, count: int) -> list[int]:
    """`count` token ids that are a pure function of (seed, name)."""
    key = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng([seed, 2, key]).integers(0, VOCAB, size=count).tolist()
