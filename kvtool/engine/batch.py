"""One iteration's batch as the scheduler builds it, and the token budget it is built within."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtool.engine.request_state import RequestState


class TokenBudget:
    """Tokens an iteration may still schedule (`max_num_tokens` at its start). Invariant: `left`
    never goes below zero through `take`."""

    def __init__(self, max_num_tokens: int) -> None:
        self.left = max_num_tokens

    def take(self, num_tokens: int) -> None:
        if num_tokens > self.left:
            raise ValueError(f"took {num_tokens} tokens of a budget with {self.left} left")
        self.left -= num_tokens


@dataclass
class Batch:
    context: list[tuple[RequestState, int]] = field(default_factory=list)
    generation: list[RequestState] = field(default_factory=list)
    first_chunks: list[RequestState] = field(default_factory=list)
    received: list[RequestState] = field(default_factory=list)
    """Generation-only requests admitted this iteration: their context arrives from elsewhere."""
    loading_started: list[RequestState] = field(default_factory=list)
    """Requests scheduled this iteration that left the batch to load asynchronously (their load
    starts with this iteration's `start_load_kv`)."""

    @property
    def num_requests(self) -> int:
        return len(self.context) + len(self.generation)

    def drop(self, state: RequestState) -> None:
        self.context = [(s, n) for s, n in self.context if s is not state]
        self.generation = [s for s in self.generation if s is not state]
        self.first_chunks = [s for s in self.first_chunks if s is not state]

    def rechunk(self, state: RequestState, num_tokens: int) -> None:
        """`state`'s chunk in this batch now computes `num_tokens` (a connector served part of it)."""
        self.context = [(s, num_tokens if s is state else n) for s, n in self.context]
