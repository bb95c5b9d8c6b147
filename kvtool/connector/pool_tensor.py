"""TensorRT-LLM V1's registration, `register_kv_caches(tensor)`, as a layout a layout-based worker
already knows how to use.

Under V1 a worker is handed one primary pool tensor `[num_blocks, num_layers, kv_factor,
block_size]` and flat block ids that index its first dimension. `layout_of_pool_tensor` describes
that tensor as a `KvCacheLayout` of one layer group with one whole-slot region, so a worker written
against `register_kv_cache_layout` (regions, `slot_tensor`, transfer backends) serves V1 unchanged:

    def register_kv_caches(self, kv_cache_tensor):
        self.register_kv_cache_layout(layout_of_pool_tensor(kv_cache_tensor, tokens_per_block))
"""

from __future__ import annotations

import torch

from kvtool.manager.layer_groups import BufferId
from kvtool.manager.layout import KvCacheLayerGroupLayout, KvCacheLayout, KvCacheRegion, PoolGroupLayout, PoolLayout
from kvtool.models import DTYPES, BufferSpec
from kvtool.types import LayerGroupId, LayerId, MemAddress, PoolGroupIndex, PoolIndex, Role


def layout_of_pool_tensor(tensor: torch.Tensor, tokens_per_block: int, model_name: str = "") -> KvCacheLayout:
    """The layout of V1's pool tensor: layer group 0 over layers 0..num_layers-1, one region whose
    page `i` is `tensor[i]` (buffers in layer order, `key` then `value`). A tensor on the meta
    device (pools without memory) gives a layout without storage. ValueError for any other shape."""
    if tensor.dim() != 4 or tensor.shape[2] not in (1, 2) or tensor.shape[3] % tokens_per_block:
        raise ValueError(f"a V1 pool tensor is [num_blocks, num_layers, kv_factor (1 or 2), tokens_per_block * "
                         f"heads * head_dim], got shape {tuple(tensor.shape)} at {tokens_per_block} tokens per block")
    num_slots, num_layers, kv_factor, elements = (int(n) for n in tensor.shape)
    itemsize = tensor.element_size()
    buffer_bytes = elements * itemsize
    slot_bytes = num_layers * kv_factor * buffer_bytes
    roles = (Role.KEY, Role.VALUE)[:kv_factor]
    buffers = tuple(BufferId(LayerId(layer), role) for layer in range(num_layers) for role in roles)
    specs = tuple(BufferSpec(role, 1, elements // tokens_per_block) for _ in range(num_layers) for role in roles)
    real = tensor.device.type != "meta"
    base = MemAddress(tensor.data_ptr() if real else 0)
    storage = tensor.reshape(num_slots, -1).view(torch.uint8).reshape(-1) if real else None
    region = KvCacheRegion(base, slot_bytes, slot_bytes, num_slots, buffers, buffer_bytes, specs,
                           PoolGroupIndex(0), PoolIndex(0), 0, storage)
    group = KvCacheLayerGroupLayout(LayerGroupId(0), tuple(LayerId(i) for i in range(num_layers)), None, (region,),
                                    PoolGroupIndex(0))
    pool_group = PoolGroupLayout(PoolGroupIndex(0), num_slots, (LayerGroupId(0),),
                                 (PoolLayout(PoolIndex(0), base, slot_bytes),))
    dtype_name = next((name for name, d in DTYPES.items() if d.torch_dtype == tensor.dtype), "")
    return KvCacheLayout(tokens_per_block, (group,), (pool_group,), model_name, dtype_name, is_virtual=not real)
