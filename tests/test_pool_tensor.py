"""V1's registration (`register_kv_caches(tensor)`) and `layout_of_pool_tensor`, which lets a layout-
based worker serve it (kvtool/connector/pool_tensor.py).

TensorRT-LLM facts (/work/notes/trtllm-v1.md section 2): `PyExecutor._maybe_init_kv_connector_manager`
hands the worker `kv_cache_manager.get_unique_primary_pool()`, shaped `[num_primary_blocks,
num_layers, kv_factor, block_size]` (`WindowBlockManager::allocatePools`; block_size =
kv heads * head_dim * tokens_per_block elements), flat block ids indexing its first dimension;
`register_kv_cache_layout` is never called (test_llm_api_connector.py assert_kv_caches_registered,
NVIDIA/TensorRT-LLM@acec56b2).
"""

from __future__ import annotations

import pytest
import torch

from kvtool.connector.pool_tensor import layout_of_pool_tensor
from kvtool.connector.request import Request
from kvtool.connectors.host import HostConnectorWorker
from kvtool.connectors.registry import load_connector
from kvtool.engine.events import EventLog, Finished
from kvtool.engine.runtimes import RuntimeName
from kvtool.manager.layer_groups import BufferId
from kvtool.types import LayerId, Role
from tests.helpers.engines import make_engine

TPB = 4
HEADS, HEAD_DIM = 2, 16


def pool(num_blocks=5, num_layers=3, kv_factor=2, dtype=torch.bfloat16, device="cpu"):
    """A V1 primary pool whose every element says where it is (block, layer, role, element)."""
    shape = (num_blocks, num_layers, kv_factor, TPB * HEADS * HEAD_DIM)
    if device == "meta":
        return torch.empty(shape, dtype=dtype, device="meta")
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).remainder(251).reshape(shape).to(dtype)


def test_page_i_of_the_layout_is_row_i_of_the_tensor_its_buffers_in_layer_order():
    tensor = pool()
    layout = layout_of_pool_tensor(tensor, TPB, "tiny")
    (group,) = layout.layer_groups
    (region,) = group.regions
    assert (layout.tokens_per_block, layout.dtype_name, layout.model_name, layout.is_virtual) \
        == (TPB, "bf16", "tiny", False)
    assert group.layer_ids == (0, 1, 2) and group.window_size is None
    assert region.buffers == tuple(BufferId(LayerId(layer), role) for layer in range(3)
                                   for role in (Role.KEY, Role.VALUE))
    assert (region.num_slots, region.buffer_bytes, region.size, region.stride) \
        == (5, TPB * HEADS * HEAD_DIM * 2, 3 * 2 * TPB * HEADS * HEAD_DIM * 2, 3 * 2 * TPB * HEADS * HEAD_DIM * 2)
    for i in range(5):
        assert region.address_of(i) == tensor[i].data_ptr()
        assert torch.equal(region.slot_tensor(i, torch.bfloat16), tensor[i].reshape(-1))
        for layer in range(3):
            for r, role in enumerate((Role.KEY, Role.VALUE)):
                at = region.buffer_offset(BufferId(LayerId(layer), role)) // 2
                assert torch.equal(region.slot_tensor(i, torch.bfloat16)[at:at + TPB * HEADS * HEAD_DIM],
                                   tensor[i, layer, r])
    # and back: the same memory, as the same tensor
    again = layout.as_single_pool_tensor()
    assert again.shape == tensor.shape and again.data_ptr() == tensor.data_ptr() and torch.equal(again, tensor)


def test_writing_a_page_through_the_layout_writes_the_tensor():
    tensor = pool()
    region = layout_of_pool_tensor(tensor, TPB).layer_groups[0].regions[0]
    region.slot_tensor(3, torch.bfloat16).fill_(-1)          # the pool's values are 0..250
    assert torch.all(tensor[3] == -1) and int((tensor == -1).sum()) == tensor[3].numel()


def test_a_key_only_pool_has_one_role():
    layout = layout_of_pool_tensor(pool(kv_factor=1), TPB)
    assert layout.layer_groups[0].regions[0].buffers == tuple(BufferId(LayerId(i), Role.KEY) for i in range(3))


def test_the_engines_own_pool_tensor_round_trips_to_its_layout():
    engine = make_engine(runtime=RuntimeName.TRTLLM_V1, tpb=TPB, num_slots=8)
    tensor = engine.manager.layout.as_single_pool_tensor()
    assert tuple(tensor.shape) == (8, 4, 2, TPB * HEADS * HEAD_DIM)
    mine, theirs = layout_of_pool_tensor(tensor, TPB).layer_groups[0], engine.manager.layout.layer_groups[0]
    assert mine.layer_ids == theirs.layer_ids
    assert [(r.base, r.size, r.stride, r.num_slots, r.buffers, r.buffer_bytes) for r in mine.regions] \
        == [(r.base, r.size, r.stride, r.num_slots, r.buffers, r.buffer_bytes) for r in theirs.regions]


def test_a_meta_tensor_gives_a_layout_without_storage():
    layout = layout_of_pool_tensor(pool(device="meta"), TPB)
    region = layout.layer_groups[0].regions[0]
    assert layout.is_virtual and region.storage is None and region.base == 0 and region.num_slots == 5
    assert layout.as_single_pool_tensor() is None and layout.single_pool_shape() == (5, 3, 2, TPB * HEADS * HEAD_DIM)


@pytest.mark.parametrize("shape", [(5, 3, TPB * 32), (5, 3, 3, TPB * 32), (5, 3, 2, TPB * 32 + 1), (5, 3, 2, 1, 4)],
                         ids=["three-dims", "kv-factor-3", "not-whole-tokens", "five-dims"])
def test_any_other_shape_is_a_value_error(shape):
    with pytest.raises(ValueError, match="a V1 pool tensor is"):
        layout_of_pool_tensor(torch.zeros(shape, dtype=torch.bfloat16), TPB)


def test_host_under_v1_registers_the_pool_tensor_and_serves_a_warm_prompt_intact(monkeypatch):
    registered = []
    original = HostConnectorWorker.register_kv_caches
    monkeypatch.setattr(HostConnectorWorker, "register_kv_caches",
                        lambda self, t: registered.append(t) or original(self, t))
    layouts = []
    original_layout = HostConnectorWorker.register_kv_cache_layout
    monkeypatch.setattr(HostConnectorWorker, "register_kv_cache_layout",
                        lambda self, layout: layouts.append(layout) or original_layout(self, layout))
    engine = make_engine(load_connector("host"), tpb=TPB, num_slots=32, runtime=RuntimeName.TRTLLM_V1,
                         local_reuse=False)
    (tensor,) = registered
    assert tuple(tensor.shape) == (32, 4, 2, TPB * HEADS * HEAD_DIM)
    assert tensor.data_ptr() == engine.manager.layout.layer_groups[0].regions[0].base   # the engine's memory
    (layout,) = layouts                                       # only through register_kv_caches' own call
    assert layout.layer_groups[0].regions[0].base == tensor.data_ptr()
    log = EventLog()
    engine.events.subscribe(log)
    prompt = list(range(700, 742))                            # 42 tokens: 10 full blocks and 2
    engine.add_request(Request(1, prompt, 3))
    engine.run()
    engine.add_request(Request(2, prompt, 3))
    engine.run()
    # V1 takes an offer whole and needs the last token computed: the 10 stored prompt blocks.
    assert [(e.request_id, e.num_external, e.failure) for e in log.of(Finished)] == [(1, 0, None), (2, 40, None)]
    assert engine.integrity_errors == 0 and engine.stats.failures == []
    assert engine.states[2].request.generated_token_ids == engine.states[1].request.generated_token_ids
