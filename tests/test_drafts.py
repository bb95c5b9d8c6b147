"""Draft tokens (speculative decoding): a decode step feeds its last token and K drafts, the verify
pass writes KV for all of them, and only the accepted drafts and one sampled token become tokens;
the radix tree commits accepted blocks only, and connectors see `num_scheduled_tokens = 1 + K`."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.connector.compat import get_draft_token_length
from kvtool.connector.loader import load_connector
from kvtool.connector.request import Request
from kvtool.engine.drafts import DraftModel
from kvtool.validate.draft_scenarios import draft_tokens
from kvtool.validate.harness import Context
from tests.helpers.engines import make_engine, sched, scripted

EXAMPLE = "examples/dict_connector.py:DictConnectorScheduler:DictConnectorWorker"
BROKEN = "tests/helpers/broken_draft_connectors.py:SavesWhatDraftsWouldComplete:StagingWorker"


def _run(draft_tokens=0, spec=None, model="tiny", new=20, acceptance=0.7, **kwargs):
    engine = make_engine(spec, model=model, draft_tokens=draft_tokens, acceptance=acceptance, **kwargs)
    for i in range(3):
        engine.add_request(Request(i, [i * 100 + t for t in range(10)], new, arrival=i * 0.5))
    engine.run()
    return engine


def test_the_draft_model_is_seeded_and_stops_at_the_first_rejection():
    model = DraftModel(3, 0.7, seed=1)
    assert model.propose(5, 40, 3) == DraftModel(3, 0.7, seed=1).propose(5, 40, 3) != model.propose(6, 40, 3)
    draws = [model.accepted(r, p, 3) for r in range(50) for p in range(40)]
    assert set(draws) == {0, 1, 2, 3} and abs(draws.count(0) / len(draws) - 0.3) < 0.05
    assert DraftModel(3, 1.0).accepted(1, 1, 3) == 3 and DraftModel(3, 0.0).accepted(1, 1, 3) == 0
    assert [model.drafts_for(10, n) for n in (0, 7, 8, 9)] == [3, 2, 1, 0]   # the step samples one token too


def test_drafts_cut_decode_iterations_and_keep_every_byte_right():
    plain, drafted = _run(0), _run(3)
    assert drafted.stats.iterations < plain.stats.iterations
    assert drafted.integrity_errors == 0 and drafted.stats.num_failed == 0
    assert [len(s.request.generated_token_ids) for s in drafted.states.values()] == [20, 20, 20]
    assert drafted.stats.generated_tokens == 60
    again = _run(3)
    assert [s.request.generated_token_ids for s in again.states.values()] == \
        [s.request.generated_token_ids for s in drafted.states.values()]          # seeded: reproducible


def test_the_connector_sees_one_plus_k_scheduled_tokens_and_only_accepted_tokens():
    engine = _run(3, scripted(lambda r, n: (0, False)))
    decode = [d for out in sched(engine).outputs for d in out.cached_requests if d.num_scheduled_tokens > 1]
    assert decode and {d.num_scheduled_tokens for d in decode} <= {2, 3, 4}
    assert max(d.num_scheduled_tokens for d in decode) == 4
    final = engine.states[0].request.get_tokens()
    reported = [t for out in sched(engine).outputs for d in out.new_requests + out.cached_requests
                if d.request_id == 0 for t in d.new_tokens]
    assert final[:len(reported)] == reported                  # never a rejected draft
    request = Request(9, [1, 2, 3], 5)
    request.py_draft_tokens = [7, 8]
    assert get_draft_token_length(request) == 2


def test_the_radix_tree_holds_blocks_of_accepted_tokens_only():
    engine = _run(3, local_reuse=True)
    tokens = engine.states[0].request.get_tokens()
    follow = engine.manager.create_kv_cache(99, tokens[:-1])
    assert follow.num_committed_tokens >= (len(tokens) - 1) // 4 * 4 - 4   # the conversation is reused
    wrong = list(tokens[:-1])
    wrong[12] += 1                                                      # a token that never happened
    diverged = engine.manager.create_kv_cache(98, wrong)
    assert diverged.num_committed_tokens <= 12


@settings(max_examples=12, deadline=None)
@given(k=st.integers(1, 4), acceptance=st.sampled_from([0.0, 0.5, 0.9, 1.0]), new=st.integers(1, 14),
       model=st.sampled_from(["tiny", "tiny-vswa"]))
def test_any_draft_setting_generates_the_requested_tokens_with_right_bytes(k, acceptance, new, model):
    engine = _run(k, scripted(lambda r, n: (0, False)), model=model, new=new, acceptance=acceptance)
    assert engine.integrity_errors == 0 and engine.stats.num_failed == 0
    assert all(len(s.request.generated_token_ids) == new for s in engine.states.values())


def test_the_draft_scenario_passes_the_example_and_catches_saving_before_acceptance():
    good = draft_tokens(Context(load_connector(EXAMPLE, {}), "tiny"))
    assert [r.verdict.value for r in good] == ["pass", "pass"]
    bad = draft_tokens(Context(load_connector(BROKEN, {}), "tiny"))
    assert bad[0].verdict.value == "fail" and "mismatch" in bad[0].evidence[0]


def test_trace_run_with_drafts_replays_in_fewer_iterations_with_right_bytes(tmp_path):
    import json

    from typer.testing import CliRunner

    from kvtool.cli import app
    runner, summaries = CliRunner(), {}
    for k in (0, 3):
        out = tmp_path / f"k{k}"
        done = runner.invoke(app, ["trace", "run", "workloads/shared_prefix.jsonl", "--connector", "host",
                                   "--no-local-reuse", "--draft-tokens", str(k), "--acceptance", "0.7",
                                   "--output", str(out)])
        assert done.exit_code == 0, done.output
        summaries[k] = json.loads((out / "summary.json").read_text())
    assert summaries[3]["iterations"] < summaries[0]["iterations"]
    assert summaries[3]["generated_tokens"] == summaries[0]["generated_tokens"]
    assert summaries[3]["integrity_errors"] == 0 and summaries[3]["failed_requests"] == 0
    assert summaries[3]["connector_hit_tokens"] > 0
    bad = runner.invoke(app, ["trace", "run", "workloads/shared_prefix.jsonl", "--draft-tokens", "2",
                              "--acceptance", "1.5"])
    assert bad.exit_code == 2 and "--acceptance is a probability" in bad.output


def test_rewound_prefix_hashes_equal_a_fresh_build_whatever_was_read_before():
    """A verify pass hashes drafts; after the rewind the real tokens at those positions must be
    hashed anew, also when the hash array was read at the longer length before (its cache)."""
    from kvtool.engine.fingerprint import PrefixHashes
    tokens, drafts = list(range(1, 21)), [900, 901, 902]
    for read_between in (False, True):
        hashes = PrefixHashes(7)
        hashes.extend_to(tokens[:17] + drafts)
        hashes.array()
        hashes.truncate(17)
        if read_between:
            hashes.array()
        hashes.extend_to(tokens)
        fresh = PrefixHashes(7)
        fresh.extend_to(tokens)
        assert hashes.array().tolist() == fresh.array().tolist()


def test_checking_every_page_after_each_iteration_does_not_change_what_drafts_generate():
    runs = [_run(3, spec=None, verify_all_after_iteration=verify) for verify in (False, True)]
    assert [s.request.generated_token_ids for s in runs[0].states.values()] == \
        [s.request.generated_token_ids for s in runs[1].states.values()]
