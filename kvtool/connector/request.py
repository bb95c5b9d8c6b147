"""The request object a connector sees.

Read-only state is exposed as properties, never methods: a bound method read as an attribute is
always truthy, which silently turns `if request.is_generation_only_request:` into a dead guard.
What changes as the request runs (its tokens, its context position, a pause) lives in a
`RequestProgress` the runtime alone holds (`progress_of`); the request only reads it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_RETENTION_PRIORITY = 35
"""TensorRT-LLM's priority of a block no retention range covers (`kDefaultRetentionPriority`)."""


@dataclass(frozen=True)
class TokenRangeRetention:
    """Prompt tokens [start, end) (end None: to the prompt's end) kept at `priority` (0-100)."""

    start: int
    end: int | None
    priority: int


@dataclass(frozen=True)
class RetentionConfig:
    """A request's KV cache retention config (TensorRT-LLM's `KvCacheRetentionConfig`): priorities
    for ranges of prompt tokens and for decode blocks. A connector sees it through V1's
    `RequestData.priorities`, one per new block."""

    token_ranges: tuple[TokenRangeRetention, ...] = ()
    decode_priority: int = DEFAULT_RETENTION_PRIORITY

    def priority_of_block(self, ordinal: int, tokens_per_block: int, prompt_len: int) -> int:
        """A block's priority: the range holding its first token for a prompt block (the default
        where none does), `decode_priority` for a block that starts past the prompt."""
        first = ordinal * tokens_per_block
        if first >= prompt_len:
            return self.decode_priority
        for r in self.token_ranges:
            if r.start <= first and (r.end is None or first < r.end):
                return r.priority
        return DEFAULT_RETENTION_PRIORITY


def cache_salt_id(cache_salt: str | None) -> int | None:
    """A stable 64-bit id of a salt (the first 8 bytes of its SHA-256), None without one."""
    if cache_salt is None:
        return None
    return int.from_bytes(hashlib.sha256(cache_salt.encode()).digest()[:8], "little")


def _kept_as_given(tokens: Sequence[int]) -> bool:
    return type(tokens) is tuple or (type(tokens) is array and tokens.itemsize == 4 and tokens.typecode in "IL")


def max_kv_tokens(prompt_len: int, max_new_tokens: int) -> int:
    """Tokens a request's KV cache holds at its largest: the prompt and every generated token but
    the last, which is never fed back."""
    return prompt_len + max(max_new_tokens - 1, 0)


class RequestProgress:
    """The engine-owned record of a request's tokens and context phase. The runtime changes a
    request only here; the `Request` a connector sees reads it and cannot change it."""

    __slots__ = ("prompt", "generated", "max_new_tokens", "context_position", "context_len", "_tokens")

    def __init__(self, prompt: Sequence[int], max_new_tokens: int) -> None:
        self.prompt = prompt
        self.generated: list[int] = []
        self.max_new_tokens = max_new_tokens
        self.context_position = 0
        self.context_len = len(prompt)
        """Tokens the context phase computes: the prompt, or (after a pause) every token so far."""
        self._tokens: list[int] | None = None
        """Prompt then generated tokens, built at the first `token_view` and kept up to date."""

    def set_context_position(self, position: int) -> None:
        self.context_position = position

    def append_token(self, token: int) -> None:
        self.generated.append(int(token))
        if self._tokens is not None:
            self._tokens.append(self.generated[-1])

    def token_view(self) -> Sequence[int]:
        """`get_tokens()` without the copy: read it, never change it (it grows as tokens are
        generated). A prefill-only request with a compact prompt (a trace's) is its prompt: it
        never grows, and 4 bytes a token need no list of ints."""
        if not self.max_new_tokens and type(self.prompt) is array and self.context_len == len(self.prompt):
            return self.prompt
        if self._tokens is None:
            self._tokens = [*self.prompt, *self.generated]
        return self._tokens

    def prompt_view(self) -> Sequence[int]:
        """`prompt_token_ids` without the copy."""
        return self.prompt if self.context_len == len(self.prompt) else self.token_view()[:self.context_len]

    def pause(self) -> None:
        """Its allocation was taken back: it will run again from the start, its tokens so far
        being the context to recompute (the generated ones stay generated)."""
        self.context_len = len(self.prompt) + len(self.generated)
        self.context_position = 0


def progress_of(request: Request) -> RequestProgress:
    """The runtime's handle on `request`'s progress: the engine changes it, kvtool's workload reader
    reads it; a connector must not call this (it reads the request), and nothing enforces that."""
    return request._progress


class Request:
    def __init__(self, request_id: int, prompt_token_ids: Sequence[int], max_new_tokens: int,
                 cache_salt: str | None = None, is_generation_only: bool = False, is_dummy: bool = False,
                 arrival: float = 0.0, retention: RetentionConfig | None = None) -> None:
        self._request_id = request_id
        prompt = prompt_token_ids if _kept_as_given(prompt_token_ids) else tuple(map(int, prompt_token_ids))
        # A tuple, or an `array` of 4-byte unsigned ints (a trace's prompts: 4 bytes a token), is kept
        # as it is: the caller vouches for plain ints and will not change it.
        self._progress = RequestProgress(prompt, max_new_tokens)
        self._cache_salt = cache_salt
        self._is_generation_only = is_generation_only
        self._is_dummy = is_dummy
        self._arrival = arrival
        self._retention = retention
        self.py_draft_tokens: list[int] = []
        """The draft tokens of its current decode step (TensorRT-LLM's attribute; drafts are not
        part of `get_tokens` until accepted)."""
        self.py_num_connector_matched_tokens = 0
        """Tokens the runtime committed to load from the connector (set at delivery: what was
        honoured, not what was offered), as TensorRT-LLM's `commit_new_matched_tokens` sets it."""

    @property
    def request_id(self) -> int:
        return self._request_id

    @property
    def py_request_id(self) -> int:
        return self._request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return list(self._progress.prompt_view())

    @property
    def prompt_len(self) -> int:
        """The context phase's length: the prompt's, or after a pause every token so far (as
        TensorRT-LLM's `LlmRequest.pause` makes the tokens generated before it part of the prompt)."""
        return self._progress.context_len

    @property
    def original_prompt_len(self) -> int:
        return len(self._progress.prompt)

    @property
    def cache_salt(self) -> str | None:
        return self._cache_salt

    @property
    def cache_salt_id(self) -> int | None:
        """The salt as the 64-bit id older TensorRT-LLM versions carry (None without a salt)."""
        return cache_salt_id(self._cache_salt)

    @property
    def max_new_tokens(self) -> int:
        return self._progress.max_new_tokens

    @property
    def num_generated_tokens(self) -> int:
        return len(self._progress.generated)

    @property
    def generated_token_ids(self) -> list[int]:
        return list(self._progress.generated)

    @property
    def is_generation_only_request(self) -> bool:
        return self._is_generation_only

    @property
    def is_dummy_request(self) -> bool:
        return self._is_dummy

    @property
    def is_finished(self) -> bool:
        return len(self._progress.generated) >= self._progress.max_new_tokens

    @property
    def context_current_position(self) -> int:
        return self._progress.context_position

    @property
    def arrival(self) -> float:
        return self._arrival

    @property
    def kv_cache_retention_config(self) -> RetentionConfig | None:
        """Its retention priorities (None: none set; V1 then reports `priorities` as None)."""
        return self._retention

    @property
    def num_connector_matched_tokens(self) -> int:
        """`py_num_connector_matched_tokens`, under the binding's name."""
        return self.py_num_connector_matched_tokens

    @property
    def lora_task_id(self) -> int | None:
        """None: kvtool's requests carry no LoRA adapter."""
        return None

    @property
    def multimodal_hashes(self) -> list[list[int]] | None:
        """None: kvtool's prompts are text only (no multimodal items)."""
        return None

    @property
    def multimodal_positions(self) -> list[int] | None:
        return None

    @property
    def multimodal_lengths(self) -> list[int] | None:
        return None

    @property
    def is_dummy(self) -> bool:
        return self._is_dummy

    def get_tokens(self, beam: int = 0) -> list[int]:
        """Prompt then generated tokens (beam search is not modelled: beam must be 0)."""
        if beam != 0:
            raise ValueError("kvtool models beam width 1")
        return list(self._progress.prompt) + self._progress.generated

    def get_num_tokens(self, beam: int = 0) -> int:
        return len(self._progress.prompt) + len(self._progress.generated)

    @property
    def last_token(self) -> int:
        """The newest token: the last generated one, else the prompt's last."""
        progress = self._progress
        return progress.generated[-1] if progress.generated else progress.prompt[-1]

    def __repr__(self) -> str:
        return (f"Request({self._request_id}, prompt_len={len(self._progress.prompt)}, "
                f"generated={len(self._progress.generated)})")
