"""`--suite store`: a block-store connector's own save and load paths, without an engine, against a
raw loop that moves the same bytes to the same place in the same run.

For each block size: a real manager's pages filled with random bytes; `save` is the worker's save of
a batch; `load` is what serving the batch costs: the scheduler's ask path (`begin_ask`, `lookup`,
`secure`: for `redis` the fetch and the checksums) and the worker's load into other pages, whose
bytes must equal the saved pages' (`verified`). Latency p50/p99: single-block saves and loads.

The raw loops, per store: `host`, one contiguous copy of the batch's bytes; `disk`, one file per
block written and fsynced, read back; `redis`, one pipeline of SETs and one MGET of the same values
with the same client library; `mooncake`, one zero-copy `batch_put_from` and `batch_get_into` from
and into registered buffers. ratio = connector GB/s / raw GB/s.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import cast

import numpy as np
import torch

from kvtool.bench.protocol_engine import commit_stores
from kvtool.bench.timing import Timing, time_repeats
from kvtool.connector.api import STORE_NAMESPACE_ENV
from kvtool.connector.loader import ConnectorSpec
from kvtool.connector.store_namespace import store_namespace
from kvtool.connectors.metadata import PageTransfer
from kvtool.connectors.store_scheduler import BlockStoreScheduler
from kvtool.connectors.store_worker import BlockStoreWorker
from kvtool.engine.worker_setup import rank_llm_args
from kvtool.errors import InputError
from kvtool.manager import KvCacheManager, KvCacheManagerConfig
from kvtool.manager.block_keys import ReuseScope, chained_block_keys
from kvtool.models import load_model

LATENCY_SAMPLES = 30
_LOST = "the store does not hold the blocks the bench just saved (too small, or failing: see the warnings above)"


@dataclass
class StoreRow:
    connector: str
    direction: str
    model: str
    tokens_per_block: int
    block_bytes: int
    batch_blocks: int
    gbps: float
    p50_us: float
    p99_us: float
    raw_gbps: float
    ratio: float
    verified: bool

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Bench:
    """One connector, one block size: the manager, both halves, the pages to save and to load into."""

    manager: KvCacheManager
    scheduler: BlockStoreScheduler
    worker: BlockStoreWorker
    keys: list[bytes]
    """The blocks saved last (what a load reads)."""
    source_pages: list[int]
    target_pages: list[int]
    tokens_per_block: int
    num_saves: int = 0

    @property
    def groups(self) -> list[int]:
        return [g.layer_group_id for g in self.manager.layout.layer_groups]

    def saves(self, blocks: range) -> list[PageTransfer]:
        """Saves of `blocks` as new blocks (fresh keys: a store skips a block it already holds)."""
        self.num_saves += 1
        self.keys = _keys(len(self.source_pages), self.tokens_per_block, seed=self.num_saves)
        return [PageTransfer(0, g, j, self.source_pages[j], self.scheduler.reserve(self.keys[j], g), self.keys[j])
                for j in blocks for g in self.groups]

    def loads(self, blocks: range) -> list[PageTransfer]:
        """The ask path of `blocks`: snapshot, lookups, secured locations; loads into the targets."""
        self.scheduler.begin_ask(self.keys, blocks.start)
        try:
            plan = {(j, g): self.scheduler.lookup(self.keys[j], g) for j in blocks for g in self.groups}
            if any(location is None for location in plan.values()):
                raise InputError(_LOST)
            secured = self.scheduler.secure(plan)
        finally:
            self.scheduler.end_ask()
        if secured is None:
            raise InputError(_LOST)
        return [PageTransfer(0, g, j, self.target_pages[j], secured[(j, g)], self.keys[j]) for (j, g) in secured]

    def pages_equal(self, blocks: range) -> bool:
        for group in self.manager.layout.layer_groups:
            for region in group.regions:
                view = region.as_tensor()
                for j in blocks:
                    if not torch.equal(view[self.source_pages[j]], view[self.target_pages[j]]):
                        return False
        return True


def run_store_suite(spec: ConnectorSpec, options: dict[str, str], model: str, tokens_per_block: list[int],
                    batch_bytes: int, repeats: int, workdir: Path) -> list[StoreRow]:
    """Rows for save and load at each block size (InputError for a store that cannot be reached)."""
    if spec.name not in RAW_LOOPS:
        raise InputError(f"--suite store measures {', '.join(RAW_LOOPS)}, not {spec.name!r}")
    rows = []
    with store_namespace(label="bench"):   # its blocks are deleted afterwards, and only its own
        for tpb in tokens_per_block:
            bench = _setup(spec, options, model, tpb, batch_bytes, workdir)
            rows += _measure(spec.name, bench, model, tpb, repeats, options, workdir)
    return rows


def _setup(spec: ConnectorSpec, options: dict[str, str], model: str, tpb: int, batch_bytes: int,
           workdir: Path) -> _Bench:
    probe = KvCacheManager(KvCacheManagerConfig(load_model(model), tpb, num_slots=1, device="cpu"))
    blocks = max(1, batch_bytes // probe.layout.bytes_per_block)
    manager = KvCacheManager(KvCacheManagerConfig(load_model(model), tpb, num_slots=2 * blocks, device="cpu"))
    llm_args = rank_llm_args(manager, spec, options, 0, 1)
    # the store suite's connectors are block stores (STORE_CONNECTORS): their ask and transfer calls are timed
    scheduler = cast(BlockStoreScheduler, spec.scheduler_class(llm_args))
    worker = cast(BlockStoreWorker, spec.worker_class(llm_args))
    worker.register_kv_cache_layout(manager.layout)
    commit_stores([worker])
    generator = torch.Generator().manual_seed(tpb)
    for group in manager.layout.layer_groups:
        for region in group.regions:
            view = region.as_tensor()
            view.copy_(torch.randint(0, 256, view.shape, dtype=torch.uint8, generator=generator))
    return _Bench(manager, scheduler, worker, [], list(range(blocks)), list(range(blocks, 2 * blocks)), tpb)


def _keys(num_blocks: int, tokens_per_block: int, seed: int) -> list[bytes]:
    tokens = [(seed * 1_000_003 + i) % (2**31 - 1) for i in range(num_blocks * tokens_per_block)]
    return [key for _, key in chained_block_keys(tokens, tokens_per_block, ReuseScope())]


def _measure(name: str, bench: _Bench, model: str, tpb: int, repeats: int, options: dict[str, str],
             workdir: Path) -> list[StoreRow]:
    num_blocks = len(bench.source_pages)
    block_bytes = bench.manager.layout.bytes_per_block
    whole = range(num_blocks)
    save = _timed(lambda: bench.worker.save(bench.saves(whole)), repeats)
    load = _timed(lambda: bench.worker.load(bench.loads(whole)), repeats)
    verified = bench.pages_equal(whole)
    one_save = _timed(lambda: bench.worker.save(bench.saves(range(1))), LATENCY_SAMPLES)
    one_load = _timed(lambda: bench.worker.load(bench.loads(range(1))), LATENCY_SAMPLES)
    cleanup = CLEANUP.get(name)
    if cleanup is not None:
        cleanup(options)
    payloads = [bytes(block_bytes)] * num_blocks
    raw_save, raw_load = RAW_LOOPS[name](payloads, repeats, options, workdir)
    nbytes = num_blocks * block_bytes
    rows = []
    for direction, batch, single, raw in (("save", save, one_save, raw_save), ("load", load, one_load, raw_load)):
        gbps = nbytes / batch.median / 1e9
        raw_gbps = nbytes / raw.median / 1e9
        rows.append(StoreRow(name, direction, model, tpb, block_bytes, num_blocks, _digits(gbps),
                             round(single.percentile_us(50), 1), round(single.percentile_us(99), 1),
                             _digits(raw_gbps), _digits(gbps / raw_gbps), verified))
    return rows


def _digits(value: float) -> float:
    """Four significant digits (a slow store's GB/s is well below 0.001 at a small batch)."""
    return float(f"{value:.4g}")


def _timed(run: Callable[[], object], repeats: int) -> Timing:
    run()                                   # warm-up: the first call opens files and connections
    return time_repeats(run, repeats, cuda=False)


def _raw_memory(payloads: list[bytes], repeats: int, options: dict[str, str], workdir: Path) -> tuple[Timing, Timing]:
    source = torch.from_numpy(np.frombuffer(b"".join(payloads), dtype=np.uint8).copy())
    target = torch.empty_like(source)
    copy = _timed(lambda: target.copy_(source), repeats)
    return copy, copy


def _raw_files(payloads: list[bytes], repeats: int, options: dict[str, str], workdir: Path) -> tuple[Timing, Timing]:
    folder = Path(tempfile.mkdtemp(prefix="raw-", dir=workdir))
    paths = [folder / f"{i}.bin" for i in range(len(payloads))]

    def write() -> None:
        for path, payload in zip(paths, payloads, strict=True):
            with path.open("wb") as handle:
                handle.write(payload)
                handle.flush()
                os.fsync(handle.fileno())

    def read() -> None:
        for path in paths:
            path.read_bytes()
    return _timed(write, repeats), _timed(read, repeats)


def _raw_redis(payloads: list[bytes], repeats: int, options: dict[str, str], workdir: Path) -> tuple[Timing, Timing]:
    from kvtool.connectors.redis_store import connect
    client = connect(options)
    keys = [f"kvtool-bench-raw:{os.getpid()}:{i}" for i in range(len(payloads))]

    def write() -> None:
        pipe = client.pipeline(transaction=False)
        for key, payload in zip(keys, payloads, strict=True):
            pipe.set(key, payload)
        pipe.execute()

    try:
        return _timed(write, repeats), _timed(lambda: client.mget(keys), repeats)
    finally:
        client.delete(*keys)


def _forget_redis_blocks(options: dict[str, str]) -> None:
    """Delete what the bench saved (its keys sit under the bench's own namespace)."""
    from kvtool.connectors.redis_store import connect
    client = connect(options)
    namespace = os.environ[STORE_NAMESPACE_ENV]
    for batch in _batched(client.scan_iter(match=f"*:{namespace}:*", count=1000), 1000):
        client.delete(*batch)


def _batched(items, size: int):
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _mooncake_client(options: dict[str, str]):
    from kvtool.connectors.mooncake_store import DEFAULT_MASTER, DEFAULT_METADATA, open_client
    from kvtool.connectors.remote_store import StoreUnavailable
    try:
        return open_client(options.get("host", "127.0.0.1"), options.get("metadata", DEFAULT_METADATA),
                           options.get("master", DEFAULT_MASTER), options.get("protocol", "tcp"),
                           options.get("device", ""))
    except StoreUnavailable as exc:
        raise InputError(f"the raw Mooncake client: {exc}") from None


def _raw_mooncake(payloads: list[bytes], repeats: int, options: dict[str, str],
                  workdir: Path) -> tuple[Timing, Timing]:
    """Zero-copy from and into registered buffers: the floor a connector on this client can reach."""
    client = _mooncake_client(options)
    source = np.frombuffer(b"".join(payloads), dtype=np.uint8).copy()
    target = np.empty_like(source)
    for buffer in (source, target):
        client.register_buffer(buffer.ctypes.data, buffer.nbytes)
    sizes = [len(p) for p in payloads]
    offsets = [int(o) for o in np.cumsum([0] + sizes)[:-1]]
    keys = [f"kvtool-bench-raw-{os.getpid()}-{i}" for i in range(len(payloads))]
    counter = iter(range(1_000_000))
    written: list[str] = []   # the keys of the last write

    def write() -> None:
        round_keys = [f"{k}-{next(counter)}" for k in keys]   # a put of an existing key is not a write
        client.batch_put_from(round_keys, [source.ctypes.data + o for o in offsets], sizes)
        written[:] = round_keys

    def read() -> None:
        client.batch_get_into(written, [target.ctypes.data + o for o in offsets], sizes)
    try:
        return _timed(write, repeats), _timed(read, repeats)
    finally:
        client.remove_by_regex(f"^kvtool-bench-raw-{os.getpid()}-", True)
        client.close()


def _forget_mooncake_blocks(options: dict[str, str]) -> None:
    client = _mooncake_client(options)
    client.remove_by_regex(f".*:{os.environ[STORE_NAMESPACE_ENV]}:.*", True)
    client.close()


CLEANUP = {"redis": _forget_redis_blocks, "mooncake": _forget_mooncake_blocks}
"""What a store keeps after the bench that must go (host memory and the scratch folder go by themselves)."""

RAW_LOOPS = {"host": _raw_memory, "host-async": _raw_memory, "host-layerwise": _raw_memory, "host-reserve": _raw_memory,
             "disk": _raw_files,
             "redis": _raw_redis, "mooncake": _raw_mooncake}
"""The raw loop each store is measured against, by connector name."""
