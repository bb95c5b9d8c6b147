"""The host connector's batched copies (issue 56): layerwise moves every request's pages of a layer
in exactly one launch per layer and direction, async one batch per pass and direction; the fake
engine verifies every byte a pass reads, and a warm round generates the cold round's tokens."""

from __future__ import annotations

import pytest

from kvtool.connector.loader import ConnectorSpec
from kvtool.connector.request import Request
from kvtool.connectors.host import HostConnectorScheduler, HostConnectorWorker
from kvtool.engine.engine import Engine, EngineConfig
from kvtool.engine.scheduler import SchedulerConfig
from kvtool.manager import KvCacheManagerConfig
from kvtool.models import load_model
from kvtool.transfer.api import layer_shifts
from kvtool.transfer.torch_backend import TorchBackend

TPB = 4
NUM_PROMPTS = 4
BLOCKS = 3


class CountingBackend(TorchBackend):
    """The torch backend, logging each launch as (direction, pages moved, ops) into `log`."""

    def __init__(self, log: list, store_tensors: set[int]) -> None:
        super().__init__()
        self.log = log
        self.store_tensors = store_tensors

    def launch(self, prepared, stream=None) -> None:
        if prepared:
            to_store = id(prepared[0].dst.tensor) in self.store_tensors
            self.log.append(("save" if to_store else "load", sum(len(op.src_slots) for op in prepared),
                             tuple(prepared)))
        super().launch(prepared, stream)


class CountingWorker(HostConnectorWorker):
    """The host worker with a `CountingBackend` and a mark in the log where each pass starts."""

    log: list = []

    def register_kv_cache_layout(self, layout) -> None:
        super().register_kv_cache_layout(layout)
        self.backend = CountingBackend(self.log, {id(s.tensor) for s in self.store.values()})

    def start_load_kv(self, stream) -> None:
        self.log.append(("pass", pages_by_group(self.meta.saves), pages_by_group(self.meta.loads)))
        super().start_load_kv(stream)


def pages_by_group(transfers) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for t in transfers:
        out.setdefault(t.layer_group_id, []).append(t.page)
    return {g: sorted(p) for g, p in out.items()}


def passes(log: list, with_marks: bool = False) -> list[list[tuple]]:
    """The log's launches split by pass (each led by its mark when `with_marks`), passes without
    a launch left out."""
    out: list[list[tuple]] = []
    for entry in log:
        if entry[0] == "pass":
            out.append([entry] if with_marks else [])
        else:
            out[-1].append(entry)
    return [p for p in out if len(p) > with_marks]


def prompts() -> list[list[int]]:
    return [[100 * (i + 1) + t for t in range(BLOCKS * TPB + TPB // 2)] for i in range(NUM_PROMPTS)]


def run_rounds(model: str, mode: str) -> tuple[Engine, list[list[int]], list[list[int]]]:
    """A cold round (every prompt in one pass: saved) then a warm round of the same prompts (loaded)."""
    CountingWorker.log = []
    config = EngineConfig(KvCacheManagerConfig(load_model(model), TPB, num_slots=64, device="cpu"),
                          SchedulerConfig(local_reuse=False, max_batch_size=NUM_PROMPTS),
                          check_integrity_every_iteration=True, verify_all_after_iteration=True)
    spec = ConnectorSpec("counting-host", HostConnectorScheduler, CountingWorker, __name__)
    engine = Engine(config, spec, {"mode": mode})
    rounds = []
    for first in (0, NUM_PROMPTS):
        for i, prompt in enumerate(prompts()):
            engine.add_request(Request(first + i, prompt, max_new_tokens=1))
        engine.run()
        rounds.append([engine.states[first + i].request.generated_token_ids for i in range(NUM_PROMPTS)])
    return engine, rounds[0], rounds[1]


def num_layers(model: str) -> int:
    return load_model(model).num_layers


@pytest.mark.parametrize("model", ["tiny", "tiny-vswa"])
def test_layerwise_moves_a_layer_of_every_request_in_one_launch_per_direction(model):
    engine, cold, warm = run_rounds(model, "layerwise")
    assert engine.integrity_errors == 0 and cold == warm
    save_pass, load_pass = passes(CountingWorker.log)
    assert [e[0] for e in save_pass] == ["save"] * num_layers(model)
    assert [e[0] for e in load_pass] == ["load"] * num_layers(model)
    cold_pass, warm_pass = passes(CountingWorker.log, with_marks=True)
    saved, loaded = cold_pass[0][1], warm_pass[0][2]
    layout = engine.manager.layout
    for direction, launches, pages in (("save", save_pass, saved), ("load", load_pass, loaded)):
        for layer, launch in enumerate(launches):   # every request's pages of the layer, in that one launch
            group = layout.group_of_layer(layer).layer_group_id
            moved = [op.src_slots if direction == "save" else op.dst_slots for op in launch[2]]
            assert all(sorted(m) == pages[group] for m in moved) and len(pages[group]) >= NUM_PROMPTS


def test_a_layers_launch_moves_that_layers_buffers_only():
    engine, _, _ = run_rounds("tiny", "layerwise")
    layout = engine.manager.layout
    region = layout.group(0).regions[0]
    save_pass, _ = passes(CountingWorker.log)
    offsets = [launch[2][0].src_offset for launch in save_pass]
    assert offsets == [layer * 2 * region.buffer_bytes for layer in range(num_layers("tiny"))]
    assert {launch[2][0].nbytes for launch in save_pass} == {2 * region.buffer_bytes}   # key and value


def test_layer_ops_share_slots_so_a_backend_builds_one_layer_and_shifts_the_rest():
    engine, _, _ = run_rounds("tiny", "layerwise")
    save_pass, _ = passes(CountingWorker.log)
    layers = [list(launch[2]) for launch in save_pass]
    chunk = layers[0][0].nbytes
    assert layer_shifts(layers) == [[(i * chunk, i * chunk)] for i in range(num_layers("tiny"))]
    assert layer_shifts([layers[0], layers[1][:0]]) is None


def test_async_moves_each_pass_in_one_launch_per_direction():
    engine, cold, warm = run_rounds("tiny", "async")
    assert engine.integrity_errors == 0 and cold == warm
    launches = [e for p in passes(CountingWorker.log) for e in p]
    assert [(e[0], e[1]) for e in launches] == [("save", NUM_PROMPTS * BLOCKS), ("load", NUM_PROMPTS * BLOCKS)]


def test_a_shifted_table_and_shifted_runs_equal_those_built_at_the_other_offsets():
    """What staged's `build_layers` relies on: layer k's descriptors and copy-engine runs are layer
    0's moved by layer k's offsets (built once, shifted 31 times on a 32-layer model)."""
    import torch

    from kvtool.transfer.api import CopyOp, PageSpace
    from kvtool.transfer.descriptors import direct_copies, op_descriptors, shifted_copy, shifted_descriptors
    pages = PageSpace.contiguous(torch.zeros(16 * 4096, dtype=torch.uint8), 4096)
    store = PageSpace.contiguous(torch.zeros(16 * 4096, dtype=torch.uint8), 4096)
    slots, rows = (3, 4, 5, 9, 1), (0, 1, 2, 3, 7)
    first, other = (CopyOp(pages, store, slots, rows, 1024, offset, offset + 512) for offset in (0, 2048))
    moved = shifted_descriptors(op_descriptors(first), 2048, 2048)
    assert moved.tolist() == op_descriptors(other).tolist()
    runs = direct_copies(first, 1)
    assert [shifted_copy(r, 2048, 2048) for r in runs] == direct_copies(other, 1)


def test_a_synchronous_batch_on_a_gpu_is_a_head_then_the_rest():
    from kvtool.connectors.host import head_and_rest
    batch = list(range(128))
    assert head_and_rest(batch, 8) == [batch[:16], batch[16:]]
    assert head_and_rest(batch, 0) == [batch]
    assert head_and_rest(batch[:5], 8) == [batch[:5]]        # too small to split: one launch


def test_sync_head_must_be_a_whole_number():
    engine_options = {"mode": "sync", "sync_head": "-1"}
    with pytest.raises(Exception, match="sync_head"):
        Engine(EngineConfig(KvCacheManagerConfig(load_model("tiny"), TPB, num_slots=16, device="cpu"),
                            SchedulerConfig()),
               ConnectorSpec("counting-host", HostConnectorScheduler, CountingWorker, __name__), engine_options)


def test_a_layer_launched_twice_in_a_pass_is_a_logic_error():
    from kvtool.connectors.layer_copies import LayerBatches, SideStream
    from kvtool.errors import LogicError
    backend, side = TorchBackend(), SideStream(False)
    batches = LayerBatches.prepare(backend, [0, 1], [[], []])
    batches.launch(0, backend, side)
    with pytest.raises(LogicError, match="layer 0"):
        batches.launch(0, backend, side)
    with pytest.raises(LogicError, match="layer 7"):
        batches.launch(7, backend, side)


def test_stacked_shifts_equal_one_shifted_table_after_another():
    import numpy as np

    from kvtool.transfer.descriptors import DESC_DTYPE, shifted_descriptors, stacked_shifted_descriptors
    descs = np.zeros(5, dtype=DESC_DTYPE)
    descs["src"], descs["dst"], descs["nbytes"] = np.arange(5) * 4096 + 2**40, np.arange(5) * 512 + 2**41, 512
    shifts = [(0, 0), (1024, 8192), (2048, -512)]
    expected = np.concatenate([shifted_descriptors(descs, s, d) for s, d in shifts])
    assert stacked_shifted_descriptors(descs, shifts).tolist() == expected.tolist()
