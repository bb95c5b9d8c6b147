"""The reference connectors: cold miss then warm hit, bit-exact, for every mode and VSWA."""

from __future__ import annotations

import warnings

import pytest
import torch

from kvtool import atomic_file
from kvtool.connector.loader import ConnectorSpec
from kvtool.connector.request import Request
from kvtool.connectors.disk import DiskConnectorScheduler, block_path, read_block, write_block
from kvtool.connectors.host import HostConnectorScheduler, HostConnectorWorker, SlotIndex, zeroed_host_bytes
from kvtool.connectors.registry import load_connector
from kvtool.engine.engine import Engine, EngineConfig
from kvtool.engine.request_state import Phase
from kvtool.engine.scheduler import SchedulerConfig
from kvtool.errors import InputError
from kvtool.manager import KvCacheManagerConfig, ReuseScope
from kvtool.manager.block_keys import chained_block_keys
from kvtool.models import load_model
from tests.helpers.memory import resident_bytes

SHARED = list(range(1000, 1040))


def requests(salt=None, offset=0, spacing=0.05):
    return [Request(offset + i, SHARED + [7 + i] * (i + 3), 4, cache_salt=salt, arrival=i * spacing)
            for i in range(4)]


def run(connector, model="tiny", options=None, reqs=None, chunk_size=None, num_slots=64, local_reuse=False):
    config = EngineConfig(KvCacheManagerConfig(load_model(model), 4, num_slots=num_slots, device="cpu"),
                          SchedulerConfig(chunk_size=chunk_size, local_reuse=local_reuse),
                          check_integrity_every_iteration=True, verify_all_after_iteration=True)
    spec = load_connector(connector) if isinstance(connector, str) else connector
    engine = Engine(config, spec, options)
    for r in reqs or requests():
        engine.add_request(r)
    engine.run()
    return engine


def tokens_of(engine):
    return {rid: s.request.generated_token_ids for rid, s in engine.states.items()}


@pytest.fixture(scope="module")
def reference():
    return {model: tokens_of(run(None, model)) for model in ("tiny", "tiny-vswa")}


@pytest.mark.parametrize("model", ["tiny", "tiny-vswa"])
@pytest.mark.parametrize("connector", ["host", "host-layerwise", "disk"])
def test_cold_miss_then_warm_hit_is_bit_exact(connector, model, reference, tmp_path):
    engine = run(connector, model, {"dir": str(tmp_path)} if connector == "disk" else None)
    hits = [engine.states[i].num_external for i in range(4)]
    assert hits == [0, 40, 40, 40]          # request 0 misses and saves; the others load the shared 10 blocks
    assert engine.integrity_errors == 0 and tokens_of(engine) == reference[model]
    assert all(s.phase is Phase.DONE for s in engine.states.values())
    assert engine.connector.scheduler.kvtool_introspection().tracked_request_ids == ()


def test_host_async_loads_and_deferred_saves(reference):
    engine = run("host-async")
    assert [engine.states[i].num_external for i in range(4)] == [0, 40, 40, 40]
    assert engine.integrity_errors == 0 and tokens_of(engine) == reference["tiny"]
    assert engine.manager.holds == [] and engine.connector.violations == []


def test_chunked_prefill_with_a_served_prefix(reference):
    engine = run("host", "tiny-vswa", chunk_size=6, reqs=requests(spacing=1.0))
    assert engine.integrity_errors == 0 and tokens_of(engine) == reference["tiny-vswa"]
    assert [engine.states[i].num_external for i in range(4)] == [0, 40, 40, 40]


def test_salt_isolation(tmp_path):
    reqs = [Request(0, SHARED + [1, 2], 2, cache_salt="a"), Request(1, SHARED + [1, 2], 2, cache_salt="b", arrival=0.1),
            Request(2, SHARED + [1, 2], 2, cache_salt="a", arrival=0.2)]
    for connector in ("host", "disk"):
        engine = run(connector, options={"dir": str(tmp_path)} if connector == "disk" else None, reqs=reqs)
        assert [engine.states[i].num_external for i in range(3)] == [0, 0, 40]


def test_whole_prompt_hit_is_clamped_and_the_tail_cancelled():
    reqs = [Request(0, SHARED, 2), Request(1, SHARED, 2, arrival=0.1)]
    engine = run("host", reqs=reqs)
    assert engine.states[1].num_external == 39 and engine.connector.cancels == [(1, 39, 40)]
    assert engine.integrity_errors == 0


def test_a_full_host_store_evicts_lru_but_never_a_pinned_entry():
    index = SlotIndex(2)
    assert (index.reserve(b"a"), index.reserve(b"b")) == (0, 1)
    index.pin(0)
    assert index.reserve(b"c") == 1 and index.lookup(b"b") is None   # b evicted: a is pinned
    index.pin(1)
    assert index.reserve(b"d") is None                                # everything pinned: no room
    index.unpin(0)
    assert index.reserve(b"d") == 0 and index.lookup(b"a") is None


def test_host_capacity_below_one_block_is_an_input_error():
    with pytest.raises(InputError, match="below one block"):
        run("host", options={"capacity": "100"})


def test_small_host_store_still_bit_exact(reference):
    engine = run("host", options={"capacity": "24KiB"})   # 12 blocks of tiny at 4 tokens per block
    assert engine.integrity_errors == 0 and tokens_of(engine) == reference["tiny"]


def test_disk_blocks_survive_the_process_and_corrupt_files_are_misses(tmp_path, reference):
    first = run("disk", options={"dir": str(tmp_path)})
    assert list(tmp_path.rglob("*.kvb")) and not list(tmp_path.rglob("*.tmp"))
    root = first.connector.scheduler.root
    keys = [key for _, key in chained_block_keys(SHARED, 4, ReuseScope())]
    victim = block_path(root, keys[0], 0)
    victim.write_bytes(victim.read_bytes()[:-7])                    # truncated
    second = block_path(root, keys[1], 0)
    data = bytearray(second.read_bytes())
    data[-1] ^= 0xFF                                               # flipped bit
    second.write_bytes(bytes(data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = run("disk", options={"dir": str(tmp_path)}, reqs=requests(offset=10))
    assert engine.integrity_errors == 0
    assert engine.connector.scheduler.num_corrupt == 2
    assert any("corrupt block" in str(w.message) for w in caught)
    assert {rid - 10: t for rid, t in tokens_of(engine).items()} == reference["tiny"]


def test_a_leftover_temp_file_is_never_a_hit(tmp_path):
    engine = run("disk", options={"dir": str(tmp_path)})
    scheduler: DiskConnectorScheduler = engine.connector.scheduler
    key = b"\x01" * 32
    path = block_path(scheduler.root, key, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.parent / f".{path.name}.123.tmp").write_bytes(b"partial")
    assert scheduler.lookup(key, 0) is None and scheduler.num_corrupt == 0


@pytest.mark.parametrize("crash_in", ["fsync", "replace"])
def test_a_save_that_crashes_midway_publishes_nothing(crash_in, tmp_path, monkeypatch):
    """Power lost before the data is durable (fsync) or before it is published (rename): the block
    must be a plain miss — no file at its name, no leftover, nothing quarantined as corrupt. A
    connector writing in place leaves a file at the block's name here."""
    engine = run("disk", options={"dir": str(tmp_path)})
    scheduler: DiskConnectorScheduler = engine.connector.scheduler
    key, payload = b"\x02" * 32, bytes(range(256)) * 64
    path = block_path(scheduler.root, key, 0)

    def crash(*args, **kwargs):
        raise OSError(5, "simulated crash")

    monkeypatch.setattr(atomic_file.os, crash_in, crash)     # the disk connector publishes through it
    with pytest.raises(OSError, match="simulated crash"):
        write_block(path, key, 0, payload)
    monkeypatch.undo()
    assert not path.exists() and [p.name for p in path.parent.iterdir() if key.hex() in p.name] == []
    assert scheduler.lookup(key, 0) is None and scheduler.num_corrupt == 0
    write_block(path, key, 0, payload)           # the next save of the block publishes it whole
    assert read_block(path, key, 0, len(payload)) == payload


class WrongSlotWorker(HostConnectorWorker):
    """Loads every block into the page of the block after it (an off-by-one in a connector)."""

    def load(self, transfers, layer_id=None):
        shifted = [type(t)(t.request_id, t.layer_group_id, t.block_ordinal, transfers[(i + 1) % len(transfers)].page,
                           t.location, t.key) for i, t in enumerate(transfers)]
        super().load(shifted, layer_id)


def test_a_connector_writing_to_the_wrong_slot_is_caught():
    spec = ConnectorSpec("wrong-slot", HostConnectorScheduler, WrongSlotWorker, "tests", {"mode": "sync"})
    engine = run(spec)
    assert engine.integrity_errors > 0
    issue = engine.fake.issues[0]
    assert issue.request_id == 1 and issue.what == "mismatch" and issue.layer_group_id == 0
    assert tokens_of(engine)[1] != tokens_of(run(None))[1]         # what garbled output looks like


def test_an_unpinned_host_store_is_zeros_and_costs_no_memory_until_written():
    """A validate scenario builds several host connectors of 256 MiB each: zeroing them took most of
    its time. The store comes from calloc: zero, committed page by page as it is written."""
    before = resident_bytes()
    store = zeroed_host_bytes(1 << 30, pin=False)
    assert resident_bytes() - before < 64 << 20            # a zero-filled GiB would be resident
    assert store.shape == (1 << 30,) and store.dtype == torch.uint8
    assert int(store[:: 1 << 16].count_nonzero()) == 0 and int(store[-4096:].count_nonzero()) == 0
    store[: 1 << 20] = 7
    assert int(store[: 1 << 20].sum()) == 7 << 20
