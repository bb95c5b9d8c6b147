"""The reference `host` connector moves a pass's blocks in one batch per direction, in every
mode: a batch of requests in one pass is one backend call of one copy per (layer group, region),
with every byte verified by the fake engine (issue 41: one call per request paid the per-call
costs once per request)."""

from __future__ import annotations

import pytest

from kvtool.bench.protocol_engine import Workload, block_bytes, build_engine, check_bytes, run_round, sized_store
from kvtool.connectors.registry import BUILTIN_CONNECTORS


class CountingBackend:
    """Passes every call to the real backend and notes (engine iteration, direction, ops)."""

    def __init__(self, inner, engine, calls: list) -> None:
        self.__dict__.update(_inner=inner, _engine=engine, _calls=calls)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def copy(self, ops, stream=None):
        self._calls.append((self._engine.iteration, ops))
        return self._inner.copy(ops, stream)


SLOTS_PER_CALL = {   # (model, mode): per backend call, the slots of each of its ops
    ("tiny", "sync"): ([[12]], [[12]]),
    ("tiny", "async"): ([[12]], [[12]]),
    # the windowed group (8 of the 12 blocks kept) saves synchronously, the full one in the background
    ("tiny-vswa", "sync"): ([[12, 12]], [[8, 12]]),
    ("tiny-vswa", "async"): ([[12], [12]], [[8, 12]]),
}


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("model", ["tiny", "tiny-vswa"])
def test_a_pass_of_four_requests_is_one_copy_call_per_direction(mode, model):
    """Four requests of three full blocks each in one pass: their saves in one call (one more
    for a windowed group's synchronous saves beside the background ones), their loads in one."""
    workload = Workload(prompts=4, blocks=3, per_pass=4)
    engine = build_engine(BUILTIN_CONNECTORS["host"], {"mode": mode}, model, 4, workload, "cpu")
    try:
        worker = engine.driver.workers[0].worker
        calls: list = []
        worker.backend = CountingBackend(worker.backend, engine, calls)
        store = {id(space.tensor) for space in worker.store.values()}
        prompts = workload.fresh_prompts(4)
        cold = run_round(engine, "host", prompts, first_id=0)
        warm = run_round(engine, "host", prompts, first_id=len(prompts))
        assert check_bytes(engine, cold, warm) is None
        assert all(engine.states[i].num_external == 3 * 4 for i in warm.ids)
        saves = [(it, ops) for it, ops in calls if all(id(op.dst.tensor) in store for op in ops)]
        loads = [(it, ops) for it, ops in calls if all(id(op.src.tensor) in store for op in ops)]
        assert len(saves) + len(loads) == len(calls)
        for batches, expected in zip((saves, loads), SLOTS_PER_CALL[model, mode], strict=True):
            assert len({it for it, _ in batches}) == 1          # one pass
            assert [[len(op.src_slots) for op in ops] for _, ops in batches] == expected
    finally:
        engine.close()


def test_the_bench_gives_kvtools_host_store_room_for_a_whole_round():
    """The host connector's 256 MiB default holds 64 blocks of llama-3.1-8b at 32 tokens a block,
    half of the default round (8 prompts of 16 blocks): the bench sizes it to the round, unless the
    user gave a capacity; other connectors keep their options."""
    host, workload = BUILTIN_CONNECTORS["host"], Workload()
    block = block_bytes("llama-3.1-8b", 32)
    assert block == 4 << 20
    assert sized_store(host, {}, "llama-3.1-8b", 32, workload) == {"capacity": str(8 * 17 * block)}
    assert sized_store(BUILTIN_CONNECTORS["host-async"], {"mode": "async"}, "tiny", 16, workload) == {
        "mode": "async", "capacity": str(8 * 17 * block_bytes("tiny", 16))}
    assert sized_store(host, {"capacity": "1GiB"}, "llama-3.1-8b", 32, workload) == {"capacity": "1GiB"}
    assert sized_store(BUILTIN_CONNECTORS["disk"], {}, "llama-3.1-8b", 32, workload) == {}
