"""Redis as a remote block store: pipelined EXISTS, MGET and SETs (one round trip each), a
password from the environment, TTL. Key naming, verification and failures: `remote_store`."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from kvtool.connector.llm_args import LlmArgs
from kvtool.connector.options import ConnectorOption
from kvtool.connectors.remote_store import REMOTE_OPTIONS, RemoteBlockStore, StoreUnavailable, seconds
from kvtool.errors import InputError

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


class RedisBlockStore(RemoteBlockStore):
    kind = "redis"

    def __init__(self, llm_args: LlmArgs, payloads: bool = True) -> None:
        super().__init__(llm_args, payloads)
        self.client = connect(llm_args.connector_options)
        self.ttl_ms = int(1000 * seconds(llm_args.connector_options.get("ttl", "0")))

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

    def _call(self, call):
        import redis
        try:
            return call()
        except redis.RedisError as exc:
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from None
