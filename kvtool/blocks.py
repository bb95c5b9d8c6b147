"""Block arithmetic shared by every layer: ceiling division and the sliding-window stale rule.

This is the one place the stale-block rule is written. The manager uses it to decide which blocks
hold no page; connectors use it (through `LlmArgs.layer_groups`) to know which blocks they will
never be asked to save or load. Two copies that drift apart corrupt data silently, so both call
`stale_block_range`.
"""

from __future__ import annotations


def ceil_div(numerator: int, denominator: int) -> int:
    """The smallest integer >= numerator / denominator, for a positive denominator."""
    return -(-numerator // denominator)


def num_blocks(num_tokens: int, tokens_per_block: int) -> int:
    """Blocks that `num_tokens` tokens occupy (the last one may be partial)."""
    return ceil_div(num_tokens, tokens_per_block)


def num_sink_blocks(num_sink_tokens: int, tokens_per_block: int) -> int:
    """Blocks holding sink tokens; they are never stale."""
    return ceil_div(num_sink_tokens, tokens_per_block)


def stale_block_range(history_length: int, tokens_per_block: int, window_size: int | None,
                      num_sink_tokens: int = 0) -> range:
    """Blocks that no later token attends to once `history_length` tokens are in the cache.

    A token at position p attends to positions p+1-window .. p (plus the sink tokens), so with
    history h the next token (position h) needs nothing before h+1-window: every block wholly
    before that position is stale, except the sink blocks at the front. Empty for full
    attention (`window_size` None).

    start = min(ceil(h / tpb), sink blocks); end = max(start, (h + 1 - window) // tpb).
    """
    if window_size is None:
        return range(0, 0)
    start = min(num_blocks(history_length, tokens_per_block),
                num_sink_blocks(num_sink_tokens, tokens_per_block))
    end = max(start, (history_length + 1 - window_size) // tokens_per_block)
    return range(start, end)


def num_live_blocks(num_tokens: int, tokens_per_block: int, window_size: int | None,
                    num_sink_tokens: int = 0) -> int:
    """Blocks of a `num_tokens` sequence that still need a page (all but the stale ones)."""
    stale = stale_block_range(num_tokens, tokens_per_block, window_size, num_sink_tokens)
    return num_blocks(num_tokens, tokens_per_block) - len(stale)
