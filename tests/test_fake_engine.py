"""The fake engine catches what a single-byte fill cannot: wrong slot, swapped layer or role, shifts."""

import numpy as np
import pytest

from kvtool.engine.fake_engine import FakeEngine, PassItem
from kvtool.engine.fingerprint import expected_bytes, PrefixHashes
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
    layer0, layer1 = view[page, :2 * region.buffer_bytes].clone(), view[page, 2 * region.buffer_bytes:4 * region.buffer_bytes].clone()
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
