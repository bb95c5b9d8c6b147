import pytest
import torch

from kvtool.errors import InputError, LayoutError, OutOfMemoryError
from kvtool.manager import BufferId, KvCacheManagerConfig, compute_layout
from kvtool.models import load_model
from kvtool.types import POOL_ALIGNMENT, Role
from tests.helpers.managers import make_manager


def layout_of(model, tpb=32, **kwargs):
    kwargs.setdefault("memory_bytes", 8 << 30)
    return compute_layout(KvCacheManagerConfig(load_model(model), tpb, **kwargs))


def test_llama_is_one_group_one_whole_slot_region():
    layout = layout_of("llama-3.1-8b")
    (group,) = layout.layer_groups
    assert group.layer_ids == tuple(range(32)) and group.window_size is None
    (region,) = group.regions
    assert region.size == region.stride == 4194304 == group.bytes_per_page
    expected = [BufferId(layer, r) for layer in range(32) for r in (Role.KEY, Role.VALUE)]
    assert list(region.buffers) == expected and len(expected) == 64
    assert region.num_slots == (8 << 30) // 4194304


def test_gemma_is_two_groups_in_two_pool_groups():
    layout = layout_of("gemma-3-27b")
    sliding, full = layout.layer_groups
    assert (len(sliding.layer_ids), sliding.window_size) == (52, 1024)
    assert (len(full.layer_ids), full.window_size) == (10, None)
    assert [pg.slot_bytes for pg in layout.pool_groups] == [13631488, 2621440]
    assert (sliding.pool_group_index, full.pool_group_index) == (0, 1)
    assert full.regions[0].base % POOL_ALIGNMENT == 0 and full.regions[0].base > 0


def test_gpt_oss_two_groups_share_one_pool_group():
    layout = layout_of("gpt-oss-20b")
    a, b = layout.layer_groups
    assert (len(a.layer_ids), a.window_size, len(b.layer_ids), b.window_size) == (12, 128, 12, None)
    (pool_group,) = layout.pool_groups
    assert pool_group.slot_bytes == 786432 and pool_group.layer_group_ids == (0, 1)
    assert a.regions[0].base == b.regions[0].base and a.regions[0].stride == 786432


def test_deepseek_at_64_tokens_per_block_is_61_key_buffers():
    (group,) = layout_of("deepseek-v3", 64).layer_groups
    (region,) = group.regions
    assert region.size == 4497408 and [b.role for b in region.buffers] == [Role.KEY] * 61


def test_num_slots_gives_every_pool_group_that_many():
    layout = layout_of("gemma-3-27b", memory_bytes=None, num_slots=7)
    assert [pg.num_slots for pg in layout.pool_groups] == [7, 7]
    assert layout.pool_groups[1].pools[0].base == 13631488 * 7 // POOL_ALIGNMENT * POOL_ALIGNMENT + POOL_ALIGNMENT


def test_memory_is_shared_by_what_a_typical_request_needs():
    layout = layout_of("gemma-3-27b")
    sliding, full = (pg.num_slots for pg in layout.pool_groups)
    # 8192 tokens: 256 full-attention pages, 32 live sliding pages ((8193-1024)//32 = 224 stale)
    assert abs(full / sliding - 256 / 32) < 0.01
    total = sum(pg.slot_bytes * pg.num_slots for pg in layout.pool_groups)
    assert 8 << 30 >= total > (8 << 30) * 0.99


def test_memory_too_small_for_one_slot():
    with pytest.raises(OutOfMemoryError, match="cannot hold one slot"):
        layout_of("llama-3.1-8b", memory_bytes=4194303)


def test_bad_config_values_are_input_errors():
    with pytest.raises(InputError, match="tokens per block"):
        layout_of("tiny", 0)
    with pytest.raises(InputError, match="exactly one"):
        layout_of("tiny", num_slots=3)


def test_address_of_and_its_bounds():
    region = layout_of("tiny", 4, memory_bytes=None, num_slots=5).layer_groups[0].regions[0]
    assert region.address_of(0) == region.base and region.address_of(4) == region.base + 4 * region.stride
    with pytest.raises(IndexError):
        region.address_of(5)
    with pytest.raises(IndexError):
        region.address_of(-1)


def test_virtual_layout_has_no_tensor():
    region = layout_of("tiny", 4, memory_bytes=None, num_slots=5).layer_groups[0].regions[0]
    with pytest.raises(LayoutError, match="without allocating"):
        region.as_tensor()


def test_as_tensor_is_a_strided_view_of_the_pool():
    manager = make_manager("tiny", 4, num_slots=5)
    region = manager.layout.group(0).regions[0]
    view = region.as_tensor(torch.bfloat16)
    assert view.shape == (5, region.size // 2) and view.stride() == (region.stride // 2, 1)
    view[3].fill_(1.0)
    raw = region.as_tensor()
    assert raw[3].view(torch.bfloat16).eq(1.0).all() and raw[2].eq(0).all()
    assert region.address_of(3) == raw[3].data_ptr()


def test_as_tensor_refuses_an_item_size_that_does_not_divide():
    manager = make_manager("tiny", 1, num_slots=3, )
    region = manager.layout.group(0).regions[0]   # 1 token x 2 heads x 16 x 2 B = 64 B per buffer
    assert region.as_tensor(torch.float64).shape == (3, region.size // 8)
    odd = make_manager("tiny", 1, num_slots=3).layout.group(0).regions[0]
    odd = type(odd)(**{**odd.__dict__, "size": 6, "stride": 6})
    with pytest.raises(ValueError, match="does not divide"):
        odd.as_tensor(torch.float32)


def test_group_lookups_and_their_errors():
    layout = layout_of("tiny-vswa", 4, memory_bytes=None, num_slots=4)
    assert layout.group_of_layer(5).layer_group_id == 1 and layout.group_of_layer(4).layer_group_id == 0
    assert layout.group(1).layer_ids == (2, 5)
    with pytest.raises(LayoutError):
        layout.group(2)
    with pytest.raises(LayoutError):
        layout.group_of_layer(6)


def test_allocated_and_virtual_layouts_agree_but_for_bases():
    config = KvCacheManagerConfig(load_model("gemma-3-27b"), 4, num_slots=3, device="cpu")
    virtual = compute_layout(config)
    manager = make_manager("gemma-3-27b", 4, num_slots=3)
    for v, a in zip(virtual.layer_groups, manager.layout.layer_groups, strict=True):
        assert [(r.size, r.stride, r.num_slots, r.buffers) for r in v.regions] == \
               [(r.size, r.stride, r.num_slots, r.buffers) for r in a.regions]
    assert not manager.layout.is_virtual and virtual.is_virtual
    assert manager.layout.group(0).regions[0].base == manager.layout.group(0).regions[0].storage.data_ptr()
