"""Tensor-parallel shards: each rank's layout holds 1/N of the KV heads (an MLA latent whole), the
fingerprints are per global head, and the shards' token digests add up to the whole model's."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.engine.fake_engine import FakeEngine
from kvtool.engine.fingerprint import expected_bytes
from kvtool.engine.pass_types import PassItem
from kvtool.errors import InputError
from kvtool.manager import KvCacheManager, KvCacheManagerConfig, compute_layout
from kvtool.models import load_model, shard_model
from kvtool.types import Role

runner = CliRunner()


def test_a_rank_holds_its_slice_of_the_heads():
    model = load_model("llama-3.1-8b")
    shard = shard_model(model, 2, 1)
    (key, value) = shard.layers[0].buffers
    assert (key.num_heads, key.first_head, value.num_heads, value.first_head) == (4, 4, 4, 4)
    assert shard.shard_name == "llama-3.1-8b tp1/2"
    whole = KvCacheManagerConfig(model, 32, num_slots=4)
    half = KvCacheManagerConfig(shard, 32, num_slots=4)
    assert compute_layout(half).layer_groups[0].bytes_per_page * 2 == \
        compute_layout(whole).layer_groups[0].bytes_per_page


def test_an_mla_latent_is_whole_on_every_rank():
    model = load_model("deepseek-v3")
    for rank in range(8):
        (latent,) = shard_model(model, 8, rank).layers[0].buffers
        assert (latent.num_heads, latent.first_head, latent.latent) == (1, 0, True)


@pytest.mark.parametrize(("tp", "rank", "words"), [(3, 0, "does not divide the 8 KV heads"),
                                                   (2, 2, "--rank must be in [0, 2)"),
                                                   (0, 0, "--tp must be at least 1")])
def test_impossible_shards_are_input_errors(tp, rank, words):
    with pytest.raises(InputError, match=words.replace("[", r"\[").replace(")", r"\)")):
        shard_model(load_model("llama-3.1-8b"), tp, rank)
    result = runner.invoke(app, ["inspect-layout", "--tp", str(tp), "--rank", str(rank)])
    assert result.exit_code == 2 and words in result.output


def test_inspect_layout_shows_one_ranks_heads():
    result = runner.invoke(app, ["inspect-layout", "--tp", "4", "--rank", "3", "--num-slots", "8", "--format", "json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["model"] == "llama-3.1-8b tp3/4"
    assert {tuple(b["heads"]) for b in doc["layer_groups"][0]["regions"][0]["buffers"]} == {(6, 8)}


@settings(max_examples=60, deadline=None)
@given(num_heads=st.sampled_from([2, 4, 8]), tp=st.sampled_from([1, 2]), layer=st.integers(0, 40),
       role=st.sampled_from([Role.KEY, Role.VALUE]), head_bytes=st.sampled_from([8, 12, 32]),
       positions=st.integers(1, 20))
def test_a_shards_fingerprints_are_its_slice_of_the_whole(num_heads, tp, layer, role, head_bytes, positions):
    hashes = np.arange(positions, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    whole = expected_bytes(hashes, layer, role, num_heads, head_bytes)
    per = num_heads // tp
    for rank in range(tp):
        shard = expected_bytes(hashes, layer, role, per, head_bytes, first_head=rank * per)
        assert np.array_equal(shard, whole[:, rank * per:(rank + 1) * per])


def _engine(model, num_slots=16):
    manager = KvCacheManager(KvCacheManagerConfig(model, 4, num_slots=num_slots, device="cpu"))
    return manager, FakeEngine(manager.layout, manager.layer_groups, seed=3)


def _forward(fake: FakeEngine, tokens: list[int]) -> PassItem:
    pages = [list(range(len(tokens) // 4 + 1))]
    fake.write_context(PassItem(1, tokens, pages, 0, len(tokens) - 1, False))
    item = PassItem(1, tokens, pages, len(tokens) - 1, len(tokens), True)
    for layer_id in fake.layer_ids:
        fake.forward_layer(layer_id, [item])
    return item


def test_the_shards_digests_add_up_to_the_whole_models_token():
    model = load_model("tiny")   # 2 KV heads
    tokens = list(range(5, 19))
    _, whole = _engine(model)
    full = _forward(whole, tokens)
    shards = [_forward(_engine(shard_model(model, 2, r))[1], tokens) for r in range(2)]
    assert (sum(s.checksum for s in shards) & ((1 << 64) - 1)) == full.checksum
    assert whole.num_integrity_errors == 0


def test_a_rank_holding_another_ranks_heads_is_caught_with_the_global_head():
    model = load_model("tiny")
    tokens = list(range(5, 19))
    (m0, rank0), (m1, rank1) = _engine(shard_model(model, 2, 0)), _engine(shard_model(model, 2, 1))
    _forward(rank1, tokens)
    for g0, g1 in zip(m0.layout.layer_groups, m1.layout.layer_groups, strict=True):
        for r0, r1 in zip(g0.regions, g1.regions, strict=True):
            r0.as_tensor().copy_(r1.as_tensor())     # rank 0's pages now hold rank 1's heads
    rank0.verify_cache(1, tokens, [list(range(4))], len(tokens))
    assert rank0.num_integrity_errors > 0
    assert {issue.head for issue in rank0.issues} == {0}
