"""The request object a connector sees.

Read-only state is exposed as properties, never methods: a bound method read as an attribute is
always truthy, which silently turns `if request.is_generation_only_request:` into a dead guard.
The runtime changes a request only through the underscore methods.
"""

from __future__ import annotations

from typing import Sequence


class Request:
    def __init__(self, request_id: int, prompt_token_ids: Sequence[int], max_new_tokens: int,
                 cache_salt: str | None = None, is_generation_only: bool = False, is_dummy: bool = False,
                 arrival: float = 0.0) -> None:
        self._request_id = request_id
        self._prompt = tuple(int(t) for t in prompt_token_ids)
        self._generated: list[int] = []
        self._max_new_tokens = max_new_tokens
        self._cache_salt = cache_salt
        self._is_generation_only = is_generation_only
        self._is_dummy = is_dummy
        self._arrival = arrival
        self._context_position = 0

    @property
    def request_id(self) -> int:
        return self._request_id

    @property
    def py_request_id(self) -> int:
        return self._request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return list(self._prompt)

    @property
    def prompt_len(self) -> int:
        return len(self._prompt)

    @property
    def cache_salt(self) -> str | None:
        return self._cache_salt

    @property
    def max_new_tokens(self) -> int:
        return self._max_new_tokens

    @property
    def num_generated_tokens(self) -> int:
        return len(self._generated)

    @property
    def generated_token_ids(self) -> list[int]:
        return list(self._generated)

    @property
    def is_generation_only_request(self) -> bool:
        return self._is_generation_only

    @property
    def is_dummy_request(self) -> bool:
        return self._is_dummy

    @property
    def is_finished(self) -> bool:
        return len(self._generated) >= self._max_new_tokens

    @property
    def context_current_position(self) -> int:
        return self._context_position

    @property
    def arrival(self) -> float:
        return self._arrival

    def get_tokens(self, beam: int = 0) -> list[int]:
        """Prompt then generated tokens (beam search is not modelled: beam must be 0)."""
        if beam != 0:
            raise ValueError("kvtool models beam width 1")
        return list(self._prompt) + self._generated

    def get_num_tokens(self, beam: int = 0) -> int:
        return len(self._prompt) + len(self._generated)

    def _set_context_position(self, position: int) -> None:
        self._context_position = position

    def _append_token(self, token: int) -> None:
        self._generated.append(int(token))

    def __repr__(self) -> str:
        return f"Request({self._request_id}, prompt_len={len(self._prompt)}, generated={len(self._generated)})"
