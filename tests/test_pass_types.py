"""The three fidelities' bytes models show the engine one face (`KvBytesModel`), and the engine
gets the one its fidelity names."""

from __future__ import annotations

import pytest

from kvtool.engine.fake_engine import FakeEngine
from kvtool.engine.fidelity import bytes_model
from kvtool.engine.no_bytes import NoBytesModel
from kvtool.engine.pass_types import KvBytesModel, PassItem
from kvtool.engine.token_model import ReferenceTokens
from tests.helpers.managers import make_manager


@pytest.mark.parametrize("fidelity, kind", [("bytes", FakeEngine), ("blocks", NoBytesModel),
                                            ("tokens", ReferenceTokens)])
def test_each_fidelity_gets_its_model_and_every_model_has_the_engines_face(fidelity, kind):
    manager = make_manager("tiny-vswa", 4, num_slots=16)
    model = bytes_model(fidelity, manager, seed=3, model_heads=0)
    assert type(model) is kind and isinstance(model, KvBytesModel)
    assert list(model.layer_ids) == sorted(layer for g in manager.layer_groups for layer in g.layer_ids)
    assert model.num_integrity_errors == 0 and model.issues == [] and not model.errors_by_request


def test_a_pass_through_the_face_writes_what_a_later_check_reads_back():
    manager = make_manager("tiny", 4, num_slots=16)
    model: KvBytesModel = bytes_model("bytes", manager, seed=3, model_heads=0)
    kv = manager.create_kv_cache(1)
    assert kv.resume() and kv.resize(8)
    tokens = list(range(8))
    item = PassItem(1, tokens, kv.page_indices_by_group(), 0, 8, samples=True)
    for layer_id in model.layer_ids:
        model.forward_layer(layer_id, [item])
    model.verify_cache(1, tokens, kv.page_indices_by_group(), 8)
    assert model.num_integrity_errors == 0
    model.verify_cache(2, [9, *tokens[1:]], kv.page_indices_by_group(), 8)   # another prompt's KV is not there
    assert model.num_integrity_errors > 0 and model.errors_by_request[2] == model.num_integrity_errors
