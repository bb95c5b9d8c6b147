"""The Redis server behind the `redis` connector: key naming, pipelined reads and writes, and the
rule that a failing server is a miss.

Keys: `{prefix}:{layout signature}:r{rank}:g{layer group}:{chained block key, hex}`. The chained
block key already includes the reuse scope (`cache_salt`); the signature names the model, dtype,
tokens per block, every layer group's page size and the tensor-parallel size, so a different model
or layout never reads a block it cannot use; the rank names the shard. Values are
`block_codec` records (header with key, group, size and SHA-256, then the page bytes).

Every call is one round trip however many blocks it names (a pipeline, no transaction). A
connection refused or dropped, a timeout, or a server error (out of memory under `noeviction`)
never escapes: reads answer "not there", writes are dropped, and both are counted and warned
about once per kind of error.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from typing import Iterable, Sequence
from urllib.parse import urlsplit

from kvtool.connector.api import STORE_NAMESPACE_ENV
from kvtool.connector.llm_args import LlmArgs
from kvtool.connector.options import ConnectorOption
from kvtool.connectors.block_codec import CorruptBlock, decode_block, encode_block, layout_signature
from kvtool.errors import InputError
from kvtool.units import parse_size

DEFAULT_URL = "redis://127.0.0.1:6379/0"
DEFAULT_PREFIX = "kvtool"
DEFAULT_STAGING = "1GiB"
_SHARD_SUFFIX = re.compile(r" tp\d+/\d+$")

Entry = tuple[bytes, int]
"""(chained block key, layer group id): one page of one block."""


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise ValueError(f"must be a number of seconds >= 0, got {text!r}")
    return value


def _url_without_password(text: str) -> None:
    parsed = urlsplit(text)
    if parsed.scheme not in ("redis", "rediss", "unix"):
        raise ValueError("must start with redis://, rediss:// or unix://")
    if parsed.password:
        raise ValueError("holds a password, which would be printed and saved with the run: name an "
                         "environment variable holding it with password_env instead")


REDIS_OPTIONS = (
    ConnectorOption("url", "the server, redis://[user@]host:port/db (rediss:// for TLS)", DEFAULT_URL,
                    check=_url_without_password),
    ConnectorOption("password_env", "the environment variable holding the password (its value is never "
                                    "printed or saved)", None),
    ConnectorOption("ttl", "seconds a stored block lives (0: until the server evicts it)", "0", check=_seconds),
    ConnectorOption("prefix", "the first part of every key", DEFAULT_PREFIX),
    ConnectorOption("timeout", "seconds to wait for the server before a call counts as failed", "2",
                    check=_seconds),
    ConnectorOption("staging", "host memory for blocks fetched at the ask and not yet loaded, e.g. 1GiB",
                    DEFAULT_STAGING, check=parse_size),
)


@dataclass(frozen=True)
class StagedEntry:
    """One page's bytes for every rank, fetched and verified at the ask (a store location)."""

    payloads: tuple[bytes, ...]

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.payloads)


def connect(options: dict[str, str]):
    """A client for the `url` option (InputError when the redis package or the password is missing)."""
    try:
        import redis
    except ImportError:
        raise InputError("the redis connector needs the redis client: pip install 'kvtool[redis]'") from None
    password = None
    if options.get("password_env"):
        name = options["password_env"]
        if name not in os.environ:
            raise InputError(f"redis connector: password_env names {name}, which is not set")
        password = os.environ[name]
    timeout = _seconds(options.get("timeout", "2"))
    try:
        return redis.Redis.from_url(options.get("url", DEFAULT_URL), password=password, socket_timeout=timeout,
                                    socket_connect_timeout=timeout)
    except ValueError as exc:
        raise InputError(f"redis connector: url: {exc}") from None


class RedisBlockStore:
    """The blocks of one layout on one server: both halves of the connector hold one."""

    def __init__(self, llm_args: LlmArgs, payloads: bool = True) -> None:
        """`payloads` False: values are headers of empty payloads (block fidelity's index), under
        a signature of their own, so they never meet a store of real blocks."""
        options = llm_args.connector_options
        self.client = connect(options)
        self.world_size = llm_args.world_size
        self.rank = llm_args.rank
        self.ttl_ms = int(1000 * _seconds(options.get("ttl", "0")))
        base_model = _SHARD_SUFFIX.sub("", llm_args.model)
        index_only = "" if payloads else " index-only"
        signature = layout_signature(f"{base_model} x{llm_args.world_size}{index_only}", llm_args)
        namespace = os.environ.get(STORE_NAMESPACE_ENV)
        prefix = options.get("prefix", DEFAULT_PREFIX) + (f":{namespace}" if namespace else "")
        self._key_head = f"{prefix}:{signature}:"
        self._payload_bytes = {g.layer_group_id: g.bytes_per_page if payloads else 0 for g in llm_args.layer_groups}
        self.num_errors = 0
        self.num_corrupt = 0
        self._warned: set[str] = set()

    def key(self, entry: Entry, rank: int) -> str:
        return f"{self._key_head}r{rank}:g{entry[1]}:{entry[0].hex()}"

    def existing(self, entries: Sequence[Entry]) -> set[Entry]:
        """Which of `entries` this rank's shard has (one round trip); none when the server fails."""
        if not entries:
            return set()
        pipe = self.client.pipeline(transaction=False)
        for entry in entries:
            pipe.exists(self.key(entry, self.rank))
        answers = self._run(pipe, "check blocks")
        return set() if answers is None else {e for e, found in zip(entries, answers) if found}

    def fetch(self, entries: Sequence[Entry]) -> dict[Entry, StagedEntry | None]:
        """Every rank's value of each entry, verified (one round trip); None for an entry that is
        missing, corrupt or of the wrong size on any rank, and for all when the server fails."""
        keys = [self.key(entry, rank) for entry in entries for rank in range(self.world_size)]
        values = self._call(lambda: self.client.mget(keys), "fetch blocks") if keys else []
        if values is None:
            return dict.fromkeys(entries)
        fetched: dict[Entry, StagedEntry | None] = {}
        for i, entry in enumerate(entries):
            shard_values = values[i * self.world_size:(i + 1) * self.world_size]
            fetched[entry] = self._verified(entry, shard_values)
        return fetched

    def _verified(self, entry: Entry, values: list) -> StagedEntry | None:
        payloads = []
        for rank, value in enumerate(values):
            if value is None:
                return None
            try:
                payloads.append(bytes(decode_block(value, entry[0], entry[1], self._payload_bytes[entry[1]],
                                                   self.key(entry, rank))))
            except CorruptBlock as exc:
                self.num_corrupt += 1
                self._warn("corrupt", f"ignoring a corrupt block ({exc}); it will be saved again")
                return None
        return StagedEntry(tuple(payloads))

    def put(self, items: Iterable[tuple[Entry, bytes]]) -> bool:
        """Store this rank's pages (one round trip); False (counted, warned) when the server fails."""
        pipe = self.client.pipeline(transaction=False)
        for entry, payload in items:
            pipe.set(self.key(entry, self.rank), encode_block(entry[0], entry[1], payload),
                     px=self.ttl_ms or None)
        return self._run(pipe, "save blocks") is not None

    def _run(self, pipe, what: str) -> list | None:
        return self._call(lambda: pipe.execute(raise_on_error=True), what)

    def _call(self, call, what: str):
        import redis
        try:
            return call()
        except redis.RedisError as exc:
            self.num_errors += 1
            self._warn(type(exc).__name__, f"could not {what} ({type(exc).__name__}: {exc}); treated as a miss")
            return None

    def _warn(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(f"kvtool redis connector: {message}", RuntimeWarning, stacklevel=3)

    def close(self) -> None:
        self.client.close()
