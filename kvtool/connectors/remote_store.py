"""A store of blocks on a remote server, as the remote connectors see it: key naming, verified reads,
and the rule that a failing server is a miss. A server kind (Redis, Mooncake Store) supplies three
batched calls; everything else is here.

Keys: `{prefix}:{layout signature}:r{rank}:g{layer group}:{chained block key, hex}`. The chained
block key already includes the reuse scope (`cache_salt`); the signature names the model, dtype,
tokens per block, every layer group's page size and the tensor-parallel size, so a different model
or layout never reads a block it cannot use; the rank names the shard. Values are `block_codec`
records (header with key, group, size and SHA-256, then the page bytes), verified on every read.

A store may be bounded (`StoreBound`: the `capacity` and `eviction` options of a store kind that
supports them, Redis): rank 0 ranks every block it writes, the scheduler ranks every block an ask
uses, and past the capacity the store drops the lowest ranked block of that layer group (every
rank's value of it), with the ranks and ties of `slot_index`'s policies, so a bounded shared store
and an in-process index of the same capacity choose the same victims.

Every call is one batched request however many blocks it names. A connection refused or dropped,
a timeout, or a server error never escapes: reads answer "not there", writes are dropped, both
counted and warned about once per kind of error. After a failure the store is left alone for
`retry_after` seconds (a dead server can cost seconds a call), then tried again.
"""

from __future__ import annotations

import os
import re
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvtool.connector.api import STORE_NAMESPACE_ENV
from kvtool.connector.llm_args import LlmArgs
from kvtool.connector.options import ConnectorOption
from kvtool.connectors.block_codec import HEADER, CorruptBlock, decode_block, encode_block, layout_signature
from kvtool.connectors.slot_index import check_eviction
from kvtool.units import parse_capacity, parse_size

DEFAULT_PREFIX = "kvtool"
DEFAULT_STAGING = "1GiB"
RETRY_AFTER_S = 1.0
_SHARD_SUFFIX = re.compile(r" tp\d+/(\d+)$")

Entry = tuple[bytes, int]
"""(chained block key, layer group id): one page of one block."""


class StoreUnavailable(Exception):
    """A call to the server failed (the store kind raises it with the reason)."""


def seconds(text: str) -> float:
    """A number of seconds >= 0; ValueError otherwise."""
    value = float(text)
    if not value >= 0:
        raise ValueError(f"must be a number of seconds >= 0, got {text!r}")
    return value


REMOTE_OPTIONS = (
    ConnectorOption("prefix", "the first part of every key", DEFAULT_PREFIX),
    ConnectorOption("staging", "host memory for blocks fetched at the ask and not yet loaded, e.g. 1GiB",
                    DEFAULT_STAGING, check=parse_size),
    ConnectorOption("retry_after", "seconds the store is left alone after a failed call", str(RETRY_AFTER_S),
                    check=seconds),
)


@dataclass(frozen=True)
class StoreBound:
    """What a bounded store holds: `blocks` per layer group (every rank's value of a block counts
    once), evicted by `policy` (`slot_index.EVICTION_POLICIES`)."""

    blocks: int
    policy: str


def store_bound(llm_args: LlmArgs, capacity_key: str = "capacity", eviction_key: str = "eviction") -> StoreBound | None:
    """The bound the options give (None: no `capacity_key`, the store keeps all it is sent). A
    size counts a whole block: every rank's shard, every layer group."""
    options = llm_args.connector_options
    if options.get(capacity_key) is None:
        return None
    shard = _SHARD_SUFFIX.search(llm_args.model)        # a shard replayed alone stands for tp of them
    shards = max(llm_args.world_size, int(shard.group(1)) if shard else 1)
    block_bytes = shards * sum(g.bytes_per_page for g in llm_args.layer_groups)
    blocks = parse_capacity(options[capacity_key]).blocks(block_bytes, llm_args.kv_cache_config.tokens_per_block)
    return StoreBound(blocks, check_eviction(options.get(eviction_key, "lru")))


@dataclass(frozen=True)
class StagedEntry:
    """One page's bytes for every rank, fetched and verified at the ask (a store location)."""

    payloads: tuple[bytes, ...]

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.payloads)


class RemoteBlockStore(ABC):
    """The blocks of one layout on one server: both halves of a remote connector hold one."""

    kind = "remote"
    """The server's name in warnings."""

    def __init__(self, llm_args: LlmArgs, payloads: bool = True, bound: StoreBound | None = None) -> None:
        """`payloads` False: values are headers of empty payloads (block fidelity's index), under
        a signature of their own, so they never meet a store of real blocks. `bound`: the store
        holds at most that many blocks a layer group (None: all it is sent)."""
        options = llm_args.connector_options
        self.world_size = llm_args.world_size
        self.rank = llm_args.rank
        base_model = _SHARD_SUFFIX.sub("", llm_args.model)
        index_only = "" if payloads else " index-only"
        signature = layout_signature(f"{base_model} x{llm_args.world_size}{index_only}", llm_args)
        namespace = os.environ.get(STORE_NAMESPACE_ENV)
        prefix = options.get("prefix", DEFAULT_PREFIX) + (f":{namespace}" if namespace else "")
        self._key_head = f"{prefix}:{signature}:"
        self.payload_bytes = {g.layer_group_id: g.bytes_per_page if payloads else 0 for g in llm_args.layer_groups}
        self.num_errors = 0
        self.num_corrupt = 0
        self._warned: set[str] = set()
        self._down_until = 0.0
        self._retry_after_s = seconds(options.get("retry_after", str(RETRY_AFTER_S)))
        self.bound = bound
        self.num_evicted = 0
        """Blocks this store object evicted (rank 0's writes do)."""

    # ---- per server kind -----------------------------------------------------------------------
    @abstractmethod
    def exist_many(self, keys: list[str]) -> list[bool]:
        """Whether each key is stored (StoreUnavailable when the server fails)."""

    @abstractmethod
    def get_many(self, keys: list[str], sizes: list[int]) -> list[bytes | None]:
        """Each key's value (None when missing; `sizes` are the expected lengths)."""

    @abstractmethod
    def put_many(self, items: list[tuple[str, bytes]]) -> None:
        """Store every (key, value) (StoreUnavailable when the server fails)."""

    def rank_many(self, entries: list[Entry], added: bool) -> int:
        """Rank `entries` in the bound's order: `added` ones just written (ranked only if new),
        else just used; evict past the bound. Returns the blocks evicted (StoreUnavailable when the
        server fails). A store kind that can be bounded implements it."""
        raise NotImplementedError(f"a {self.kind} store cannot be bounded")

    def count_evicted(self) -> int:
        """Blocks the bounded store has evicted, whoever's write made it (StoreUnavailable when the
        server fails). A store kind that can be bounded implements it."""
        raise NotImplementedError(f"a {self.kind} store cannot be bounded")

    # ---- what the connector calls ----------------------------------------------------------------
    @property
    def key_head(self) -> str:
        """What every key of this store begins with (prefix, namespace, layout signature)."""
        return self._key_head

    def evicted_total(self) -> int | None:
        """Blocks the bounded store evicted, every engine's writes together (None: not bounded, or
        the server did not answer)."""
        return None if self.bound is None else self._guarded(self.count_evicted, "count evictions")

    def key(self, entry: Entry, rank: int) -> str:
        return f"{self._key_head}r{rank}:g{entry[1]}:{entry[0].hex()}"

    def value_bytes(self, layer_group_id: int) -> int:
        return HEADER.size + self.payload_bytes[layer_group_id]

    def existing(self, entries: Sequence[Entry]) -> set[Entry]:
        """Which of `entries` this rank's shard has (one call); none when the server fails."""
        if not entries:
            return set()
        found = self._guarded(lambda: self.exist_many([self.key(e, self.rank) for e in entries]), "check blocks")
        return set() if found is None else {e for e, present in zip(entries, found, strict=True) if present}

    def fetch(self, entries: Sequence[Entry]) -> dict[Entry, StagedEntry | None]:
        """Every rank's value of each entry, verified (one call); None for an entry that is missing,
        corrupt or of the wrong size on any rank, and for all when the server fails."""
        if not entries:
            return {}
        keys = [self.key(e, rank) for e in entries for rank in range(self.world_size)]
        sizes = [self.value_bytes(e[1]) for e in entries for _ in range(self.world_size)]
        values = self._guarded(lambda: self.get_many(keys, sizes), "fetch blocks")
        if values is None:
            return dict.fromkeys(entries)
        n = self.world_size
        return {e: self._verified(e, values[i * n:(i + 1) * n]) for i, e in enumerate(entries)}

    def put(self, items: Iterable[tuple[Entry, bytes]]) -> bool:
        """Store this rank's pages (one call), then, on rank 0 of a bounded store, rank them (and
        evict past the bound); False (counted, warned) when the server fails."""
        items = list(items)
        encoded = [(self.key(entry, self.rank), encode_block(entry[0], entry[1], payload)) for entry, payload in items]
        if not encoded:
            return True
        if self._guarded(lambda: self.put_many(encoded) or True, "save blocks") is None:
            return False
        if self.bound is not None and self.rank == 0:
            self.num_evicted += self._guarded(lambda: self.rank_many([e for e, _ in items], added=True),
                                              "rank blocks") or 0
        return True

    def touch(self, entries: Sequence[Entry]) -> None:
        """Count `entries` as used by an ask (a bounded store ranks them; others do nothing)."""
        if self.bound is not None and entries:
            self._guarded(lambda: self.rank_many(list(entries), added=False), "rank blocks")

    def _verified(self, entry: Entry, values: list) -> StagedEntry | None:
        payloads = []
        for rank, value in enumerate(values):
            if value is None:
                return None
            try:
                payload = decode_block(value, entry[0], entry[1], self.payload_bytes[entry[1]], self.key(entry, rank))
            except CorruptBlock as exc:
                self.num_corrupt += 1
                self._warn("corrupt", f"ignoring a corrupt block ({exc}); it will be saved again")
                return None
            payloads.append(bytes(payload))
        return StagedEntry(tuple(payloads))

    def _guarded(self, call, what: str):
        """`call()`, or None when the server fails (or failed less than `retry_after` ago)."""
        if time.monotonic() < self._down_until:
            return None
        try:
            return call()
        except StoreUnavailable as exc:
            self.num_errors += 1
            self._down_until = time.monotonic() + self._retry_after_s
            self._warn(str(exc).split(":")[0], f"could not {what} ({exc}); treated as a miss")
            return None

    def _warn(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(f"kvtool {self.kind} connector: {message}", RuntimeWarning, stacklevel=3)
