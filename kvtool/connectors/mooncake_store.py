"""Mooncake Store as a remote block store: `batch_is_exist`, and the zero-copy `batch_get_into` /
`batch_put_from` through one registered host buffer (a batch larger than the buffer goes in
several calls). Key naming, verification and failures: `remote_store`.

The engine's client contributes no memory to the pool (`global_segment_size` 0): the blocks live
in the segments of the store's own processes (`mooncake_client`), so they outlive every engine.
Before the first call the master's RPC port is probed (a client set up against a dead master
blocks for minutes); a store that cannot be reached is a miss, tried again after `retry_after`.
"""

from __future__ import annotations

import os
import socket
import threading

import numpy as np

from kvtool.connector.llm_args import LlmArgs
from kvtool.connector.options import ConnectorOption
from kvtool.connectors.remote_store import REMOTE_OPTIONS, RemoteBlockStore, StoreUnavailable
from kvtool.errors import InputError
from kvtool.units import parse_size

DEFAULT_MASTER = "127.0.0.1:50051"
DEFAULT_METADATA = "http://127.0.0.1:8080/metadata"
OBJECT_NOT_FOUND = -704
"""Mooncake's error code for a key it does not hold (a miss, not a failure)."""
PROBE_TIMEOUT_S = 1.0


def _host_port(text: str) -> None:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError("must be HOST:PORT")


MOONCAKE_OPTIONS = REMOTE_OPTIONS + (
    ConnectorOption("master", "the master's RPC address, HOST:PORT", DEFAULT_MASTER, check=_host_port),
    ConnectorOption("metadata", "the metadata server (the master's HTTP one: http://HOST:PORT/metadata)",
                    DEFAULT_METADATA),
    ConnectorOption("protocol", "the transfer protocol", "tcp", ("tcp", "rdma")),
    ConnectorOption("device", "RDMA device names (protocol rdma)", ""),
    ConnectorOption("host", "this client's address as the store sees it", "127.0.0.1"),
    ConnectorOption("buffer", "the registered host buffer a batch moves through, e.g. 64MiB", "64MiB",
                    check=parse_size),
)


def probe(host: str | None, port: int) -> None:
    """OSError unless something listens at host:port (a Mooncake setup against nothing blocks for
    minutes; a connect says at once)."""
    socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()


def open_client(host: str, metadata: str, master: str, protocol: str = "tcp", device: str = ""):
    """A Mooncake Store client contributing no memory to the pool; StoreUnavailable (with the
    reason) when the master cannot be reached, InputError when Mooncake is not installed."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError:
        raise InputError("the mooncake connector needs Mooncake Store: pip install 'kvtool[mooncake]' "
                         "(and apt-get install -y libibverbs1)") from None
    master_host, _, port = master.rpartition(":")
    try:
        probe(master_host, int(port))
    except OSError as exc:
        raise StoreUnavailable(f"master {master} unreachable: {exc}") from None
    # The transfer engine otherwise advertises the first non-loopback address, not `host` (and
    # finds none in a private network namespace).
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)
    client = MooncakeDistributedStore()
    if client.setup(host, metadata, 0, 16 << 20, protocol, device, master) != 0:
        raise StoreUnavailable(f"setup against master {master} failed")
    return client


class MooncakeBlockStore(RemoteBlockStore):
    kind = "mooncake"

    def __init__(self, llm_args: LlmArgs, payloads: bool = True) -> None:
        super().__init__(llm_args, payloads)
        options = llm_args.connector_options
        self.master = options.get("master", DEFAULT_MASTER)
        self.metadata = options.get("metadata", DEFAULT_METADATA)
        self.protocol = options.get("protocol", "tcp")
        self.device = options.get("device", "")
        self.host = options.get("host", "127.0.0.1")
        self.buffer_bytes = parse_size(options.get("buffer", "64MiB"))
        if self.buffer_bytes < max(self.value_bytes(g) for g in self.payload_bytes):
            raise InputError(f"mooncake connector: buffer {self.buffer_bytes} bytes holds less than one page")
        self._client = None
        self._buffer: np.ndarray | None = None
        self._lock = threading.Lock()
        """One buffer: a background save and a foreground call never share it at once."""

    def exist_many(self, keys: list[str]) -> list[bool]:
        with self._lock:
            codes = self._connected().batch_is_exist(keys)
        failed = [c for c in codes if c < 0]
        if failed:
            raise StoreUnavailable(f"batch_is_exist: error {failed[0]}")
        return [c == 1 for c in codes]

    def get_many(self, keys: list[str], sizes: list[int]) -> list[bytes | None]:
        values: list[bytes | None] = []
        with self._lock:
            client = self._connected()
            for chunk, offsets in self._chunks(sizes):
                codes = client.batch_get_into([keys[i] for i in chunk], self._addresses(offsets),
                                              [sizes[i] for i in chunk])
                failures = [c for c in codes if c < 0 and c != OBJECT_NOT_FOUND]
                if failures and all(c < 0 for c in codes):   # nothing came back: the store failed
                    raise StoreUnavailable(f"batch_get_into: error {failures[0]}")
                buffer = self._registered()
                values += [buffer[o:o + c].tobytes() if c >= 0 else None
                           for o, c in zip(offsets, codes, strict=True)]
        return values

    def put_many(self, items: list[tuple[str, bytes]]) -> None:
        sizes = [len(value) for _, value in items]
        with self._lock:
            client = self._connected()
            for chunk, offsets in self._chunks(sizes):
                for i, offset in zip(chunk, offsets, strict=True):
                    self._registered()[offset:offset + sizes[i]] = np.frombuffer(items[i][1], dtype=np.uint8)
                codes = client.batch_put_from([items[i][0] for i in chunk], self._addresses(offsets),
                                              [sizes[i] for i in chunk])
                failed = [c for c in codes if c < 0]
                if failed:
                    raise StoreUnavailable(f"batch_put_from: error {failed[0]} ({len(failed)} of {len(codes)})")

    def _chunks(self, sizes: list[int]) -> list[tuple[list[int], list[int]]]:
        """Runs of indices of `sizes` that fit the buffer, each with its values' offsets in it."""
        chunks: list[tuple[list[int], list[int]]] = []
        current: list[int] = []
        offsets: list[int] = []
        used = 0
        for i, size in enumerate(sizes):
            if current and used + size > self.buffer_bytes:
                chunks.append((current, offsets))
                current, offsets, used = [], [], 0
            current.append(i)
            offsets.append(used)
            used += size
        return chunks + ([(current, offsets)] if current else [])

    def _registered(self) -> np.ndarray:
        """The buffer registered with the client (set by `_connected`, which every caller ran first)."""
        assert self._buffer is not None
        return self._buffer

    def _addresses(self, offsets: list[int]) -> list[int]:
        base = self._registered().ctypes.data
        return [base + offset for offset in offsets]

    def _connected(self):
        if self._client is not None:
            return self._client
        client = open_client(self.host, self.metadata, self.master, self.protocol, self.device)
        buffer = np.zeros(self.buffer_bytes, dtype=np.uint8)
        if client.register_buffer(buffer.ctypes.data, buffer.nbytes) != 0:
            client.close()
            raise StoreUnavailable("register_buffer failed")
        self._client, self._buffer = client, buffer
        return client
