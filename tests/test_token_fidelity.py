"""`tokens` fidelity (validate's reference runs) generates exactly the tokens of a `bytes` run with
no connector, on every model shape, with chunked prefill, local reuse, drafts and squeezed pools."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.connector.loader import ConnectorSpec
from kvtool.engine.engine import Engine
from kvtool.errors import InputError
from kvtool.validate.harness import Context, Req, engine_config, tokens

NONE = ConnectorSpec("none", object, object, "")


def generated(ctx: Context, requests: list[Req], reference: bool, num_slots: int, chunk: int | None) -> dict:
    engine = Engine(engine_config(ctx, num_slots, chunk, True, 8, reference=reference))
    for q in requests:
        engine.add_request(q.build())
    engine.run(max_iterations=5000)
    assert engine.fake.num_integrity_errors == 0
    return {rid: s.request.generated_token_ids for rid, s in engine.states.items()}


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(["tiny", "tiny-vswa"]), st.integers(0, 3), st.sampled_from([None, 3, 17]),
       st.sampled_from([0, 2]), st.lists(st.tuples(st.integers(1, 3), st.integers(5, 70), st.integers(1, 5)),
                                         min_size=1, max_size=5))
def test_tokens_fidelity_generates_the_bytes_runs_tokens(model, seed, chunk, drafts, shapes):
    ctx = Context(NONE, model, 16, (), seed, draft_tokens=drafts)
    shared = tokens(7, 40)   # a common prefix: local reuse serves later requests from earlier pages
    requests = [Req(i, shared[:prefix * 10] + tokens(100 + i, length), max_new_tokens=new, arrival=float(i))
                for i, (prefix, length, new) in enumerate(shapes)]
    for num_slots in (256, 24):
        assert generated(ctx, requests, True, num_slots, chunk) == generated(ctx, requests, False, num_slots, chunk)


def test_tokens_fidelity_refuses_a_connector():
    from kvtool.connectors.registry import load_connector
    with pytest.raises(InputError, match="reference run"):
        Engine(engine_config(Context(NONE, "tiny"), 64, None, False, 8, reference=True), load_connector("host"))
