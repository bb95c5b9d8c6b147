"""Streams that lose every race (`kvtool.engine.stream_races`), what a CPU can check: the fake
engine's read-first order computes the same tokens and finds the same wrong bytes as its usual
order, a delay runs once per layer, the connector's streams are spun at load hooks only, and the
planted stream-order connectors are the host connector where there is no stream. The races
themselves run on a GPU: tests/gpu/test_stream_races_gpu.py."""

from __future__ import annotations

import torch

from kvtool.connectors.host import HostConnectorWorker
from kvtool.connectors.registry import load_connector
from kvtool.engine import stream_races
from kvtool.engine.fake_engine import FakeEngine
from kvtool.engine.pass_types import PassItem
from kvtool.engine.stream_races import StreamRaces
from kvtool.manager.manager import POISON_BYTE
from tests.helpers.managers import make_manager

PLANTED = "tests/helpers/stream_connectors.py"


def _two_passes(delay=None):
    """A 12-token prefill, then its 13th token (reads the 12 earlier ones): sampled tokens, errors."""
    manager = make_manager("tiny", 4, num_slots=8)
    cache = manager.create_kv_cache(1, [])
    cache.resume()
    cache.resize(13)
    fake = FakeEngine(manager.layout, manager.layer_groups, delay_writes=delay)
    tokens = list(range(40, 53))
    sampled = []
    for start, end in ((0, 12), (12, 13)):
        item = PassItem(1, tokens, cache.page_indices_by_group(), start, end, True)
        for layer in fake.layer_ids:
            fake.forward_layer(layer, [item])
        sampled.append(fake.sample(item))
    return fake, sampled, manager, cache


def test_reading_first_then_writing_computes_the_same_tokens_once_delayed_per_layer():
    calls = []
    plain, plain_tokens, _, _ = _two_passes()
    delayed, delayed_tokens, _, _ = _two_passes(lambda: calls.append(1))
    assert delayed_tokens == plain_tokens
    assert delayed.num_integrity_errors == plain.num_integrity_errors == 0
    assert len(calls) == 2 * len(delayed.layer_ids)           # one delay per layer per pass


def test_reading_first_still_finds_a_page_never_written():
    fake, _, manager, cache = _two_passes(lambda: None)
    page = cache.page_indices_by_group()[0][1]
    manager.layout.group(0).regions[0].as_tensor()[page] = POISON_BYTE     # block 1 lost its bytes
    item = PassItem(1, list(range(40, 53)), cache.page_indices_by_group(), 12, 13, True)
    fake.forward_layer(fake.layer_ids[0], [item])
    assert fake.num_integrity_errors == 4 * 2 * 2              # 4 positions x 2 heads x key and value, layer 0
    assert {(i.block_ordinal, i.layer_id, i.role) for i in fake.issues} == {(1, 0, "key"), (1, 0, "value")}


def test_writes_are_delayed_on_the_forward_stream_and_connector_streams_only_at_load_hooks():
    spins = []
    races = StreamRaces(0.001, {"start_load_kv": 0.002},
                        spin_on=lambda seconds, stream: spins.append((seconds, stream)))
    races.install()
    try:
        assert torch.cuda.Stream.__new__ is not stream_races._ORIGINAL_NEW   # streams made now are noted
        races.before_writes()
        for hook in ("save_kv_layer", "wait_for_save", "get_finished", "start_load_kv", "wait_for_layer_load"):
            races.before_hook(hook)   # no stream was made on this CPU: nothing to spin at the load hooks
        assert spins == [(0.001, None)]
    finally:
        races.uninstall()
    assert torch.cuda.Stream.__new__ is stream_races._ORIGINAL_NEW


def test_the_planted_stream_connectors_are_the_host_connector_on_a_cpu():
    for names in ("SideStreamSaves:SideStreamSavesWorker", "SideStreamLoads:SideStreamLoadsWorker"):
        spec = load_connector(f"{PLANTED}:{names}")
        assert issubclass(spec.worker_class, HostConnectorWorker)
        assert {"save", "load"} & set(vars(spec.worker_class))   # each overrides one direction
