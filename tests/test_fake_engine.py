"""The fake engine catches what a single-byte fill cannot: wrong slot, swapped layer or role, shifts."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvtool.engine.byte_origin import Coordinate, Origins
from kvtool.engine.fake_engine import FakeEngine
from kvtool.engine.fingerprint import PrefixHashes, expected_bytes, mix64, unmix64
from kvtool.engine.pass_types import PassItem
from kvtool.group_pages import GroupPages
from kvtool.manager.manager import POISON_BYTE, RELEASED_POISON_BYTE
from kvtool.types import BAD_PAGE_INDEX, Role
from tests.helpers.managers import make_manager


@pytest.fixture
def setup():
    manager = make_manager("tiny", 4, num_slots=8)
    cache = manager.create_kv_cache(1, [])
    cache.resume()
    cache.resize(12)
    fake = FakeEngine(manager.layout, manager.layer_groups)
    item = PassItem(1, list(range(40, 52)), cache.page_indices_by_group(), 0, 12, True)
    for layer in fake.layer_ids:
        fake.forward_layer(layer, [item])
    return manager, cache, fake


def test_a_clean_pass_has_no_errors_and_a_deterministic_token(setup):
    manager, cache, fake = setup
    assert fake.num_integrity_errors == 0
    again = FakeEngine(manager.layout, manager.layer_groups)
    item = PassItem(1, list(range(40, 52)), cache.page_indices_by_group(), 11, 12, True)
    for layer in again.layer_ids:
        again.forward_layer(layer, [item])
    first = PassItem(1, list(range(40, 52)), cache.page_indices_by_group(), 11, 12, True)
    for layer in fake.layer_ids:
        fake.forward_layer(layer, [first])
    assert again.sample(item) == fake.sample(first)


def test_fingerprints_differ_by_every_coordinate():
    hashes = PrefixHashes(0)
    hashes.extend_to([1, 2, 3])
    h = hashes.array()
    base = expected_bytes(h, 0, Role.KEY, 2, 32)
    assert not np.array_equal(base[0], base[1])                       # position
    assert not np.array_equal(base, expected_bytes(h, 1, Role.KEY, 2, 32))     # layer
    assert not np.array_equal(base, expected_bytes(h, 0, Role.VALUE, 2, 32))   # role
    assert not np.array_equal(base[:, 0], base[:, 1])                 # head
    assert not np.array_equal(base[:, :, :8], base[:, :, 8:16])        # words inside a head
    other = PrefixHashes(0)
    other.extend_to([9, 2, 3])
    assert not np.array_equal(base[2], expected_bytes(other.array(), 0, Role.KEY, 2, 32)[2])  # the prefix


def test_a_block_in_the_wrong_slot_is_reported_with_its_coordinates(setup):
    manager, cache, fake = setup
    view = manager.layout.group(0).regions[0].as_tensor()
    pages = cache.get_page_indices(0)
    view[pages[1]] = view[pages[2]].clone()          # block 2's bytes where block 1 should be
    fake.verify_cache(1, list(range(40, 52)), cache.page_indices_by_group(), 12)
    assert fake.num_integrity_errors == 4 * 2 * 4 * 2   # 4 positions x 2 heads x 4 layers x 2 roles
    first = fake.issues[0]
    assert (first.request_id, first.layer_group_id, first.block_ordinal, first.layer_id, first.role,
            first.position, first.head) == (1, 0, 1, 0, "key", 4, 0)


def test_swapped_layers_are_caught(setup):
    manager, cache, fake = setup
    region = manager.layout.group(0).regions[0]
    view = region.as_tensor()
    page = cache.get_page_indices(0)[0]
    layer0 = view[page, :2 * region.buffer_bytes].clone()
    layer1 = view[page, 2 * region.buffer_bytes:4 * region.buffer_bytes].clone()
    view[page, :2 * region.buffer_bytes] = layer1
    view[page, 2 * region.buffer_bytes:4 * region.buffer_bytes] = layer0
    fake.verify_cache(1, list(range(40, 52)), cache.page_indices_by_group(), 12)
    assert {i.layer_id for i in fake.issues} == {0, 1} and {i.block_ordinal for i in fake.issues} == {0}


def test_a_read_of_a_missing_page_is_an_error(setup):
    manager, cache, fake = setup
    pages = cache.page_indices_by_group()
    holed = GroupPages([pages[0][:1] + (BAD_PAGE_INDEX,) + pages[0][2:]])
    fake.verify_cache(1, list(range(40, 52)), holed, 12)
    assert fake.issues[0].what == "read of a block with no page"


@pytest.mark.parametrize("fill, meaning", [
    (POISON_BYTE, "found a page that was never written since it was handed out (a5a5a5a5a5a5a5a5)"),
    (RELEASED_POISON_BYTE, "found a released page (dededededededede)"),
    (0, "found zeros (0000000000000000)"),
])
def test_poison_and_zeros_are_said_in_words_before_the_bytes(setup, fill, meaning):
    manager, cache, fake = setup
    manager.layout.group(0).regions[0].as_tensor()[cache.get_page_indices(0)[1]] = fill
    fake.verify_cache(1, list(range(40, 52)), cache.page_indices_by_group(), 12)
    assert meaning in fake.issues[0].describe(), fake.issues[0].describe()


def test_bytes_that_only_begin_like_poison_are_shown_as_bytes(setup):
    manager, cache, fake = setup
    page = manager.layout.group(0).regions[0].as_tensor()[cache.get_page_indices(0)[1]]
    page[:] = POISON_BYTE
    page[8::64] = 1                                  # past the first 8 bytes of each head: not a poisoned head
    fake.verify_cache(1, list(range(40, 52)), cache.page_indices_by_group(), 12)
    assert fake.issues[0].found == "a5a5a5a5a5a5a5a5", fake.issues[0]


def test_a_page_poisoned_on_hand_out_and_on_release_reads_back_as_which():
    manager = make_manager("tiny", 4, num_slots=8, poison_new_pages=True)
    fake = FakeEngine(manager.layout, manager.layer_groups)
    cache = manager.create_kv_cache(1, [])
    cache.resume()
    assert cache.resize(8)
    tokens, pages = list(range(40, 48)), cache.page_indices_by_group()
    fake.verify_cache(1, tokens, pages, 8)                    # nothing written since they were handed out
    assert "found a page that was never written since it was handed out" in fake.issues[0].describe()
    fake.write_context(PassItem(1, tokens, pages, 0, 8, False))
    cache.close()                                              # nothing committed: both pages freed
    released = FakeEngine(manager.layout, manager.layer_groups)
    released.verify_cache(1, tokens, pages, 8)                # a read after the release
    assert "found a released page (dededededededede)" in released.issues[0].describe()


# ---- whose bytes a wrong head holds (byte_origin) ----------------------------------------------
def _heads(manager, page):
    """One page as [buffer (layer, role), position in block, head, byte]."""
    region = manager.layout.group(0).regions[0]
    tpb = manager.layout.tokens_per_block
    view = region.as_tensor().view(region.num_slots, len(region.buffers), tpb, 2, -1)
    return view[page]


def _found_at(fake, position, layer=0, role="key", head=0):
    return next(i.found for i in fake.issues
                if (i.position, i.layer_id, i.role, i.head) == (position, layer, role, head))


@given(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=50))
def test_unmix64_undoes_the_fingerprint_mixer(values):
    x = np.array(values, dtype=np.uint64)
    assert (unmix64(mix64(x)) == x).all() and (mix64(unmix64(x)) == x).all()


def _first_word(hashes: PrefixHashes, position: int, layer: int, role: Role, head: int, num_heads: int) -> int:
    raw = expected_bytes(hashes.array()[position:position + 1], layer, role, num_heads, 16)
    return int(raw[0, head, :8].view(np.uint64)[0])


def test_a_shard_traces_another_ranks_heads():
    """Rank 0 of --tp 8 holds heads 0-3 of 32 and traces all 32 (`models.heads_across_ranks`)."""
    hashes = PrefixHashes()
    hashes.extend_to(list(range(10, 20)))
    origins = Origins({3: hashes}, [0, 1], num_heads=32)
    word = _first_word(hashes, 6, 1, Role.VALUE, 27, 32)
    assert origins.describe(word, Coordinate(3, 6, 1, Role.VALUE, 2)) == "the bytes of head 27"


def test_a_rewound_request_is_traced_by_its_tokens_now_not_its_drafts():
    hashes = PrefixHashes()
    hashes.extend_to([1, 2, 3, 4, 5, 6])
    origins = Origins({7: hashes}, [0], num_heads=2)
    draft = _first_word(hashes, 5, 0, Role.KEY, 0, 2)
    assert origins.describe(draft, Coordinate(7, 3, 0, Role.KEY, 0)) == "the bytes of position 5"
    hashes.truncate(4)
    hashes.extend_to([1, 2, 3, 4, 50, 60])              # the drafts were rejected; other tokens came
    assert origins.describe(draft, Coordinate(7, 3, 0, Role.KEY, 0)) is None     # not "position 5" any more
    now = _first_word(hashes, 5, 0, Role.KEY, 1, 2)
    assert origins.describe(now, Coordinate(7, 5, 0, Role.KEY, 0)) == "the bytes of head 1"


def test_finished_requests_are_remembered_but_padding_dummies_are_not():
    live = {}
    origins = Origins(live, [0], num_heads=1)
    for request_id, first in ((4, 100), (-1001, 0)):
        live[request_id] = PrefixHashes()
        live[request_id].extend_to([first, 1, 2])
    words = {rid: _first_word(live[rid], 2, 0, Role.KEY, 0, 1) for rid in live}
    for request_id in list(live):
        origins.forget(request_id)
        del live[request_id]
    assert origins.describe(words[4], Coordinate(9, 2, 0, Role.KEY, 0)) == "the bytes of request 4, position 2"
    assert origins.describe(words[-1001], Coordinate(9, 2, 0, Role.KEY, 0)) is None


def test_a_block_in_the_wrong_slot_says_whose_position_it_holds(setup):
    manager, cache, fake = setup
    pages = cache.get_page_indices(0)
    _heads(manager, pages[1])[:] = _heads(manager, pages[2]).clone()     # block 2 where block 1 belongs
    fake.verify_cache(1, list(range(40, 52)), cache.page_indices_by_group(), 12)
    assert _found_at(fake, 4).startswith("the bytes of position 8 (")
    assert _found_at(fake, 7, layer=1, role="value", head=1).startswith("the bytes of position 11 (")


def test_swapped_layers_roles_and_heads_are_named(setup):
    manager, cache, fake = setup
    page = _heads(manager, cache.get_page_indices(0)[0])
    original = page.clone()
    page[0], page[2] = original[2], original[0]           # layer 0's keys <-> layer 1's keys
    page[5] = original[4]                                 # layer 2's values hold its keys
    page[6, :, 0], page[6, :, 1] = original[6, :, 1], original[6, :, 0]   # layer 3's key heads swapped
    fake.verify_cache(1, list(range(40, 52)), cache.page_indices_by_group(), 12)
    assert _found_at(fake, 0).startswith("the bytes of layer 1 (")
    assert _found_at(fake, 2, layer=1).startswith("the bytes of layer 0 (")
    assert _found_at(fake, 3, layer=2, role="value", head=1).startswith("the bytes of the key (")
    assert _found_at(fake, 1, layer=3, head=0).startswith("the bytes of head 1 (")


def test_another_requests_block_names_the_request_even_after_it_is_forgotten(setup):
    manager, cache, fake = setup
    other = manager.create_kv_cache(2, [])
    other.resume()
    other.resize(8)
    tokens = list(range(900, 908))
    item = PassItem(2, tokens, other.page_indices_by_group(), 0, 8, True)
    for layer in fake.layer_ids:
        fake.forward_layer(layer, [item])
    fake.forget(2)                                       # finished: a connector may still serve its blocks
    _heads(manager, cache.get_page_indices(0)[1])[:] = _heads(manager, other.get_page_indices(0)[1]).clone()
    fake.verify_cache(1, list(range(40, 52)), cache.page_indices_by_group(), 12)
    assert _found_at(fake, 5, layer=2).startswith("the bytes of request 2, position 5 (")


def test_bytes_shifted_inside_a_head_and_a_head_wrong_after_its_first_word_are_said(setup):
    manager, cache, fake = setup
    page = _heads(manager, cache.get_page_indices(0)[2])
    page[0, 0, 0] = page[0, 0, 0].roll(-16)             # position 8, layer 0 key head 0: 16 bytes early
    page[1, 1, 1, 9] ^= 0xFF                           # position 9, layer 0 value head 1: byte 9 wrong
    fake.verify_cache(1, list(range(40, 52)), cache.page_indices_by_group(), 12)
    assert _found_at(fake, 8).startswith("its own bytes, shifted by 16 bytes (")
    assert _found_at(fake, 9, role="value", head=1).startswith("its own first bytes, wrong from byte 9 of the head (")


def test_bytes_no_known_coordinate_wrote_are_shown_as_bytes(setup):
    manager, cache, fake = setup
    page = _heads(manager, cache.get_page_indices(0)[1])
    page[0, 0, 0, :8] = torch.tensor(list(range(1, 9)), dtype=torch.uint8)
    fake.verify_cache(1, list(range(40, 52)), cache.page_indices_by_group(), 12)
    assert _found_at(fake, 4) == "0102030405060708"


def test_parts_moved_to_another_device_keep_their_shapes_order_and_bytes_in_one_copy(monkeypatch):
    """`moved` puts a layer's buffers side by side for one copy (on a GPU each copy synchronises).
    Here the copy to the other device is a clone on the host, so the bytes can be compared."""
    from kvtool.engine.integrity import moved as _moved
    parts = [torch.arange(24, dtype=torch.uint8).view(3, 2, 4), torch.arange(100, 118, dtype=torch.uint8).view(3, 2, 3)]
    assert _moved(parts, torch.device("cpu")) is parts
    copies = []
    monkeypatch.setattr(torch.Tensor, "to", lambda self, device: copies.append(device) or self.clone())
    moved = _moved(parts, torch.device("meta"))
    assert copies == [torch.device("meta")]
    assert [tuple(m.shape) for m in moved] == [(3, 2, 4), (3, 2, 3)]
    assert all(torch.equal(m, p) for m, p in zip(moved, parts, strict=True))
