"""Draft tokens (speculative decoding: MTP, Eagle, a draft model), as the runtime around the
connector sees them: a generation step feeds its last token and K drafts (TensorRT-LLM's
`num_scheduled_tokens = 1 + get_draft_token_length(request)`), the verify pass writes KV for all
1 + K positions, and only the accepted drafts and one sampled token become the request's tokens.
The KV written for rejected drafts belongs to tokens that never happened.

No draft model runs: drafts and their acceptance are drawn from a seeded hash of (request,
position), so a run is reproducible and independent of what the connector does; an accepted draft
is the token the request generates at that position.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtool.engine.fingerprint import mix_int

_DRAFT_SALT = 0xD0AF7
_ACCEPT_SALT = 0xACCE97
_UNIT = float(1 << 53)


@dataclass(frozen=True)
class DraftModel:
    num_tokens: int
    """K: drafts per generation step (0: off)."""
    acceptance: float
    """The probability that a draft is accepted, given the ones before it were."""
    seed: int = 0
    vocab_size: int = 32000

    def drafts_for(self, max_new_tokens: int, num_generated: int) -> int:
        """Drafts of the next step: K, fewer when the request has fewer tokens left to generate
        (the step also samples one token of its own)."""
        return max(0, min(self.num_tokens, max_new_tokens - num_generated - 1))

    def propose(self, request_id: int, position: int, count: int) -> list[int]:
        """The draft tokens for positions [position, position + count)."""
        return [self._hash(_DRAFT_SALT, request_id, position + i) % self.vocab_size for i in range(count)]

    def accepted(self, request_id: int, position: int, count: int) -> int:
        """How many of the `count` drafts from `position` on are accepted: the leading run of
        independent draws below `acceptance`."""
        for i in range(count):
            if (self._hash(_ACCEPT_SALT, request_id, position + i) >> 11) / _UNIT >= self.acceptance:
                return i
        return count

    def _hash(self, salt: int, request_id: int, position: int) -> int:
        return mix_int(mix_int((self.seed << 20) ^ salt ^ (request_id << 32)) ^ position)
