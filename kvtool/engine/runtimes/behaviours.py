"""What a connector meets differently under each runtime, behaviour by behaviour, each row naming
the TensorRT-LLM source it was read from.

The one table: `docs/trtllm-compat.md` prints it (a test holds the two together), and when a
scenario fails under one runtime and passes under another, `kvtool validate` names the rows the
scenario exercises (`differences`), so that a connector that relied on one runtime's behaviour is
told which difference it met.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtool.engine.runtimes.names import RuntimeName
from kvtool.types import TextEnum

V1, V2, RELEASE = RuntimeName.TRTLLM_V1, RuntimeName.TRTLLM_V2, RuntimeName.TRTLLM_V2_RELEASE


class Behaviour(TextEnum):
    CHOSEN_WHEN = "chosen-when"
    REGISTRATION = "registration"
    WHEN_ASKED = "when-asked"
    ASKED_AGAIN = "asked-again"
    FIRST_CHUNK_PAGES = "first-chunk-pages"
    WHOLE_PROMPT_OFFER = "whole-prompt-offer"
    UNUSED_OFFER = "unused-offer"
    ZERO_ASYNC = "zero-async"
    HOOK_FORMS = "hook-forms"
    BLOCK_HASHES = "block-hashes"
    PRIORITIES = "priorities"
    PREFIX_RESERVATIONS = "prefix-reservations"
    CAPACITY_POLICY = "capacity-policy"
    REFUSED = "refused"


@dataclass(frozen=True)
class BehaviourRow:
    behaviour: Behaviour
    what: str
    by_runtime: dict[RuntimeName, str]
    source: str
    """The TensorRT-LLM file, function or PR this row was read from."""


BEHAVIOURS: tuple[BehaviourRow, ...] = (
    BehaviourRow(Behaviour.CHOSEN_WHEN, "chosen when", {
        V1: "`use_kv_cache_manager_v2=\"auto\"` for every model without a V2 preference (Llama, ...)",
        V2: "models preferring V2 (DeepSeek, Gemma 3, GPT-OSS, ...), or set explicitly, on `main`",
        RELEASE: "the same, on release branches carrying #18700"},
        "llmapi/llm_utils.py `_resolve_kv_cache_manager_v2_auto`"),
    BehaviourRow(Behaviour.REGISTRATION, "how a worker gets the cache", {
        V1: "`register_kv_caches(tensor)`: the one primary pool `[num_blocks, num_layers, kv_factor, block_size]`; "
            "`register_kv_cache_layout` is never called",
        V2: "`register_kv_cache_layout(layout)` (its default passes a one-pool cache to `register_kv_caches`)",
        RELEASE: "as `trtllm-v2`"},
        "py_executor.py `_maybe_init_kv_connector_manager`; test_llm_api_connector.py `test_connector_simple`"),
    BehaviourRow(Behaviour.WHEN_ASKED, "when the connector is asked", {
        V1: "while the sequence is added at its first chunk, only once the whole prompt's pages are granted: "
            "never deferred after the ask",
        V2: "once the batch is final (`prepare_resources`): never deferred after the ask; a connector with "
            "the reservation hooks is asked `reserve_prefix` during scheduling instead, and a rejected "
            "candidate is released and asked again (a fresh id) at its next attempt",
        RELEASE: "during scheduling, before the first chunk's pages: a request may be deferred after its ask "
                 "and delivered iterations later"},
        "kvCacheManager.cpp `addSequence`; kv_cache_manager_v2.py `_run_kv_connector_hooks`; #18700"),
    BehaviourRow(Behaviour.ASKED_AGAIN, "asked again", {
        V1: "never: GUARANTEED_NO_EVICT never destroys an allocation, so nothing replays",
        V2: "once per allocation: a request whose allocation was destroyed (a pause) is asked again and "
            "reported new",
        RELEASE: "once per request across deferrals (the offer is memoised), again after a pause (a new "
                 "allocation), reported new"},
        "kv_cache_manager_v2.py `free_resources` (`py_connector_allocation_reported`)"),
    BehaviourRow(Behaviour.FIRST_CHUNK_PAGES, "pages at the first chunk", {
        V1: "the whole prompt's (later chunks report `new_block_ids == []`)",
        V2: "the chunk's (grown when the offer reaches past it); later chunks as append-deltas",
        RELEASE: "the chunk's (and the offer's); later chunks as append-deltas"},
        "resource_manager.py `KVCacheManager.prepare_resources`; test_llm_api_connector.py "
        "`test_connector_scheduler_output_chunked_context`"),
    BehaviourRow(Behaviour.WHOLE_PROMPT_OFFER, "an offer of the whole prompt", {
        V1: "refused: the request fails (`prepopulatedPromptLen >= promptLen`); a connector offers at most "
            "`prompt_len - 1` tokens",
        V2: "clamped to `prompt_len - 1`; the last token is not handed back",
        RELEASE: "clamped to `prompt_len - 1`; `cancel_load` for the last position"},
        "llmRequest.h `setPrepopulatedPromptLen`; kv_cache_manager_v2.py `_apply_connector_matched_prefix`"),
    BehaviourRow(Behaviour.UNUSED_OFFER, "offered tokens not used", {
        V1: "none: an offer is taken whole at once",
        V2: "not handed back (no `cancel_load`): what a failed grow could not hold is recomputed and let go at "
            "`request_finished`",
        RELEASE: "handed back with `cancel_load(request, start, end)`: the clamped tail, an overtaken head, a "
                 "failed reserve, a request freed before delivery"},
        "connectors/kv_cache_connector.py `commit_new_matched_tokens`; release `cancel_load`"),
    BehaviourRow(Behaviour.ZERO_ASYNC, "an answer of `(0, True)`", {
        V1: "refused: the request fails", V2: "refused: the request fails",
        RELEASE: "a contract violation, taken as `(0, False)`"},
        "connectors/kv_cache_connector.py `query_num_new_matched_tokens`"),
    BehaviourRow(Behaviour.HOOK_FORMS, "page-list hooks", {
        V1: "flat: `update_state_after_alloc(request, block_ids)`, `request_finished(request, block_ids)`, "
            "pool-wide ids; `new_block_ids_by_layer_group == []`",
        V2: "per layer group (`*_by_layer_group`, `List[List[int]]`, `BAD_PAGE_INDEX` in place)",
        RELEASE: "as `trtllm-v2`"},
        "connectors/kv_cache_connector.py @035ab91c"),
    BehaviourRow(Behaviour.BLOCK_HASHES, "`RequestData.block_hashes`", {
        V1: "the request's chain of full-block hashes so far, on every report (#14806)",
        V2: "`[]`", RELEASE: "`[]`"},
        "connectors/kv_cache_connector.py `build_scheduler_output`; #14806"),
    BehaviourRow(Behaviour.PRIORITIES, "`RequestData.priorities`", {
        V1: "None without a retention config; one per new block with one",
        V2: "None", RELEASE: "None"},
        "test_llm_api_connector.py `test_connector_priorities`"),
    BehaviourRow(Behaviour.PREFIX_RESERVATIONS, "prefix reservations", {
        V1: "none", V2: "for a connector implementing `reserve_prefix`, `release_prefix_reservation` and "
                        "`get_finished_prefix_loads` (all three, else refused): `SchedulerOutput.prefix_loads`",
        RELEASE: "none"},
        "connectors/prefix_load_completion.py; the connector docs' \"Reserving a prefix during admission\""),
    BehaviourRow(Behaviour.CAPACITY_POLICY, "capacity policies with a connector", {
        V1: "GUARANTEED_NO_EVICT only", V2: "any (MAX_UTILIZATION pauses and replays)", RELEASE: "any"},
        "py_executor_creator.py; test_llm_api_connector.py `test_connector_max_utilization_is_rejected_on_v1_only`"),
    BehaviourRow(Behaviour.REFUSED, "refused at bring-up", {
        V1: "VSWA, a host or disk tier, a capacity policy other than GUARANTEED_NO_EVICT (beam > 1, attention DP, "
            "pp/cp > 1: not reachable in kvtool)",
        V2: "a host or disk tier, speculative decoding, a partial reservation implementation",
        RELEASE: "a host or disk tier"},
        "py_executor.py `_maybe_init_kv_connector_manager`, `_reject_non_gpu_cache_tiers`"),
)

ROWS = {row.behaviour: row for row in BEHAVIOURS}


def differences(behaviours: tuple[Behaviour, ...], failing: RuntimeName, passing: RuntimeName) -> list[str]:
    """In words, how `failing` differs from `passing` in `behaviours` (rows where they differ)."""
    out = []
    for behaviour in behaviours:
        row = ROWS[behaviour]
        there, here = value(row, failing), value(row, passing)
        if there != here:
            out.append(f"{row.what}: {failing}: {there}; {passing}: {here}")
    return out


def value(row: BehaviourRow, runtime: RuntimeName) -> str:
    """`row`'s text for `runtime`, a cell that reads "as `other`" resolved to the other's."""
    text = row.by_runtime[runtime]
    if text.startswith("as `") and text.endswith("`"):
        return value(row, RuntimeName(text[4:-1]))
    return text


def markdown_table() -> str:
    """The table as docs/trtllm-compat.md prints it: a row per behaviour, a column per runtime, the source last."""
    names = list(RuntimeName)
    lines = ["| behaviour | " + " | ".join(f"`{n}`" for n in names) + " | read from |",
             "| --- | " + " | ".join("---" for _ in names) + " | --- |"]
    for row in BEHAVIOURS:
        cells = [row.by_runtime[n].replace("|", "\\|") for n in names]
        lines.append(f"| {row.what} | " + " | ".join(cells) + f" | {row.source} |")
    return "\n".join(lines) + "\n"
