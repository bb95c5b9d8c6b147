"""Redis as a remote block store: pipelined EXISTS, MGET and SETs (one round trip each), a
password from the environment, TTL, and a bound. Key naming, verification and failures:
`remote_store`.

A bounded store (`capacity`, `eviction`) keeps a sorted set per layer group of the blocks it holds,
ranked by a counter every use and write takes a tick of (LRU: the tick of the last use; LFU: uses
x 2**32 + that tick, so ties go to the least recent). One Lua script ranks a batch, a block at a
time as the in-process index does: a new block in a full set first evicts the lowest ranked
(ZPOPMIN), and every rank's key of each victim is deleted at the end, but for a victim the batch
itself adds again (its value was just written). It runs atomically, whichever engine sends it: one order
for all the engines sharing the server."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from kvtool.connector.llm_args import LlmArgs
from kvtool.connector.options import ConnectorOption
from kvtool.connectors.remote_store import REMOTE_OPTIONS, RemoteBlockStore, StoreUnavailable, seconds, store_bound
from kvtool.connectors.slot_index import EVICTION_POLICIES
from kvtool.errors import InputError
from kvtool.units import parse_capacity

DEFAULT_URL = "redis://127.0.0.1:6379/0"


def _url_without_password(text: str) -> None:
    parsed = urlsplit(text)
    if parsed.scheme not in ("redis", "rediss", "unix"):
        raise ValueError("must start with redis://, rediss:// or unix://")
    if parsed.password:
        raise ValueError("holds a password, which would be printed and saved with the run: name an "
                         "environment variable holding it with password_env instead")


REDIS_OPTIONS = REMOTE_OPTIONS + (
    ConnectorOption("url", "the server, redis://[user@]host:port/db (rediss:// for TLS)", DEFAULT_URL,
                    check=_url_without_password),
    ConnectorOption("password_env", "the environment variable holding the password (its value is never "
                                    "printed or saved)", None),
    ConnectorOption("ttl", "seconds a stored block lives (0: until the server evicts it)", "0", check=seconds),
    ConnectorOption("timeout", "seconds to wait for the server before a call counts as failed", "2",
                    check=seconds),
    ConnectorOption("capacity", "bound the shared store: tokens (1e7) or a size (1TiB; SI units such as 10GB too) "
                    "of whole blocks, every rank's shard, a layer group at a time (all the engines sharing it "
                    "together) [default: no bound]", None, check=parse_capacity),
    ConnectorOption("eviction", "which block a bounded store drops: lru or lfu (as the index tier)", "lru",
                    tuple(EVICTION_POLICIES)),
)


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
    timeout = seconds(options.get("timeout", "2"))
    try:
        return redis.Redis.from_url(options.get("url", DEFAULT_URL), password=password, socket_timeout=timeout,
                                    socket_connect_timeout=timeout)
    except ValueError as exc:
        raise InputError(f"redis connector: url: {exc}") from None


RANK_SCRIPT = """
local head, world, policy, capacity, added = ARGV[1], tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4]), ARGV[5] == '1'
local count = (#ARGV - 5) / 2
local tick = redis.call('INCRBY', head .. 'tick', count) - count
local evicted, doomed = 0, {}
for i = 0, count - 1 do
  local group, hex = ARGV[6 + 2 * i], ARGV[7 + 2 * i]
  local ranks = head .. 'index:g' .. group
  local old = redis.call('ZSCORE', ranks, hex)
  tick = tick + 1
  if added and not old then
    if redis.call('ZCARD', ranks) >= capacity then
      local victim = redis.call('ZPOPMIN', ranks, 1)
      doomed[':g' .. group .. ':' .. victim[1]] = true
      evicted = evicted + 1
    end
    doomed[':g' .. group .. ':' .. hex] = nil      -- written by this batch: its value stays
    redis.call('ZADD', ranks, policy == 'lfu' and (4294967296 + tick) or tick, hex)
  elseif not added and old then
    local uses = policy == 'lfu' and math.floor(tonumber(old) / 4294967296) or 0
    redis.call('ZADD', ranks, policy == 'lfu' and ((uses + 1) * 4294967296 + tick) or tick, hex)
  end
end
for suffix, _ in pairs(doomed) do
  for rank = 0, world - 1 do redis.call('DEL', head .. 'r' .. rank .. suffix) end
end
if evicted > 0 then redis.call('INCRBY', head .. 'evicted', evicted) end
return evicted
"""
"""Ranks a batch of entries (ARGV: key head, ranks, policy, capacity, 1 for written / 0 for used,
then group and hex key of each) and evicts past the capacity; returns the blocks evicted."""


class RedisBlockStore(RemoteBlockStore):
    kind = "redis"

    def __init__(self, llm_args: LlmArgs, payloads: bool = True,
                 bound_keys: tuple[str, str] = ("capacity", "eviction")) -> None:
        """`bound_keys`: the options that bound it (capacity, eviction), if given."""
        super().__init__(llm_args, payloads, store_bound(llm_args, *bound_keys))
        self.client = connect(llm_args.connector_options)
        self.ttl_ms = int(1000 * seconds(llm_args.connector_options.get("ttl", "0")))
        self._rank = self.client.register_script(RANK_SCRIPT)

    def exist_many(self, keys: list[str]) -> list[bool]:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        return [bool(n) for n in self._call(lambda: pipe.execute(raise_on_error=True))]

    def get_many(self, keys: list[str], sizes: list[int]) -> list[bytes | None]:
        return self._call(lambda: self.client.mget(keys))

    def put_many(self, items: list[tuple[str, bytes]]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for key, value in items:
            pipe.set(key, value, px=self.ttl_ms or None)
        self._call(lambda: pipe.execute(raise_on_error=True))

    def rank_many(self, entries: list[tuple[bytes, int]], added: bool) -> int:
        assert self.bound is not None, "only a bounded store ranks"
        args: list[str | int] = [self.key_head, self.world_size, self.bound.policy, self.bound.blocks, int(added)]
        for key, group in entries:
            args += [group, key.hex()]
        return int(self._call(lambda: self._rank(args=args)))

    def count_evicted(self) -> int:
        return int(self._call(lambda: self.client.get(self.key_head + "evicted")) or 0)

    def _call(self, call):
        import redis
        try:
            return call()
        except redis.RedisError as exc:
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from None
