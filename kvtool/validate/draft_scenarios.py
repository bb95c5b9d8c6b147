"""The draft-token scenario: speculative decoding (MTP, Eagle, a draft model) writes KV for 1 + K
positions per decode step, and only the accepted drafts become tokens. A connector must save a
block only from KV of tokens that happened: blocks completed by accepted drafts (known only at the
next report) and never bytes of rejected drafts."""

from __future__ import annotations

from dataclasses import replace

from kvtool.engine.runtimes.names import RuntimeName
from kvtool.validate.harness import Context, Req, Scenario, reference_tokens, run, tokens
from kvtool.validate.judges import judge_integrity, judge_warm_hit
from kvtool.validate.results import CheckResult

DRAFT_TOKENS = 3


def draft_tokens(ctx: Context) -> list[CheckResult]:
    """Requests decoding with 3 drafts a step (acceptance 0.7, seeded), then their conversations
    continued (prompt and answer): the answers' blocks, completed by accepted drafts or by steps
    whose last drafts were rejected, are what serves the continuations."""
    drafted = replace(ctx, draft_tokens=DRAFT_TOKENS)
    T = ctx.tokens_per_block
    first = [Req(i, tokens(80 + i, 2 * T + 1), max_new_tokens=4 * T) for i in range(3)]
    answers = reference_tokens(drafted, first)
    again = [Req(10 + q.request_id, q.tokens + tuple(answers[q.request_id][:-1]), arrival=3.0 + q.request_id)
             for q in first]
    r = run(drafted, first + again)
    return [judge_integrity("draft-tokens", drafted, [(r, first + again)]),
            judge_warm_hit("draft-tokens", drafted, r, [q.request_id for q in again])]


DRAFT_SCENARIOS = (
    Scenario("draft-tokens", "decode steps with 3 draft tokens (some rejected), then the conversations continued",
             draft_tokens, runs_on=frozenset({RuntimeName.TRTLLM_V1, RuntimeName.TRTLLM_V2_RELEASE}),
             not_here="main's KVCacheManagerV2 refuses a connector with speculative decoding"),
)
