"""The fingerprinting engine on GPU pages: a layer's read is compared on the host when small
(`HOST_COMPARE_BYTES`) and on the GPU otherwise; both must catch one wrong byte, at its coordinates,
and agree on the pass's checksum. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from kvtool.engine import fake_engine
from kvtool.engine.fake_engine import FakeEngine
from kvtool.engine.pass_types import PassItem
from kvtool.manager.config import KvCacheManagerConfig
from kvtool.manager.manager import KvCacheManager
from kvtool.models import load_model

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _run(device: str, corrupt: bool) -> FakeEngine:
    manager = KvCacheManager(KvCacheManagerConfig(load_model("tiny"), 4, num_slots=8, device=device))
    cache = manager.create_kv_cache(1, [])
    cache.resume()
    assert cache.resize(12)
    fake = FakeEngine(manager.layout, manager.layer_groups)
    tokens, pages = list(range(40, 52)), cache.page_indices_by_group()
    fake.write_context(PassItem(1, tokens, pages, 0, 11, False))
    if corrupt:     # position 5's key, head 1, its 3rd byte, in layer 0
        region = manager.layout.group(0).regions[0]
        view = region.as_tensor().view(region.num_slots, len(region.buffers), 4, 2, -1)
        view[pages[0][1], 0, 1, 1, 2] ^= 0xFF
    item = PassItem(1, tokens, pages, 11, 12, True)
    for layer in fake.layer_ids:
        fake.forward_layer(layer, [item])
    fake.token = fake.sample(item)
    return fake


@pytest.mark.parametrize("compare_bytes", [0, 1 << 30], ids=["on-the-gpu", "on-the-host"])
def test_one_wrong_byte_is_caught_where_it_is_and_checksums_match_the_cpu(monkeypatch, compare_bytes):
    monkeypatch.setattr(fake_engine, "HOST_COMPARE_BYTES", compare_bytes)
    cpu = _run("cpu", corrupt=False)
    compared_on, verify = set(), FakeEngine._verify

    def spy(self, *args):
        found = verify(self, *args)
        compared_on.add(found.device.type if found is not None else None)
        return found
    monkeypatch.setattr(FakeEngine, "_verify", spy)
    clean = _run("cuda", corrupt=False)
    assert clean.num_integrity_errors == 0 and clean.token == cpu.token
    broken = _run("cuda", corrupt=True)
    assert compared_on - {None} == ({"cuda"} if compare_bytes == 0 else {"cpu"})
    assert broken.num_integrity_errors == 1
    issue = broken.issues[0]
    assert (issue.position, issue.layer_id, issue.role, issue.head) == (5, 0, "key", 1), issue
    flipped = bytearray(bytes.fromhex(issue.expected))
    flipped[2] ^= 0xFF
    assert f"found {flipped.hex()}" in issue.describe(), issue.describe()
