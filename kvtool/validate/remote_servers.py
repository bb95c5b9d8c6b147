"""What the remote scenarios do to the server under test (`--remote URL`), per server kind:
`redis://HOST:PORT/DB` or `mooncake://HOST:RPC_PORT?metadata=URL`. A server kind that cannot do
something (Mooncake cannot pause or drop its clients) says so, and the scenario is skipped."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

from kvtool.errors import InputError


class RemoteControl:
    """A server the remote scenarios disrupt; `can_pause` and `can_drop_connections` say which of
    those disruptions it supports (the scenarios skip the others)."""

    kind: str
    can_pause = False
    can_drop_connections = False

    def check(self) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        raise NotImplementedError

    def pause(self, milliseconds: int) -> None:
        raise NotImplementedError(f"{self.kind} cannot pause its clients")

    def drop_connections(self) -> None:
        raise NotImplementedError(f"{self.kind} cannot drop its clients' connections")


class RedisControl(RemoteControl):
    kind = "Redis"
    can_pause = True
    can_drop_connections = True

    def __init__(self, url: str) -> None:
        try:
            import redis
        except ImportError:
            raise InputError("--remote redis:// needs the redis client: pip install 'kvtool[redis]'") from None
        self._redis = redis
        try:
            self.client = redis.Redis.from_url(url, socket_timeout=5)
        except ValueError as exc:
            raise InputError(str(exc)) from None

    def check(self) -> None:
        try:
            self.client.ping()
        except self._redis.RedisError as exc:
            raise InputError(f"the server does not answer ({exc})") from None

    def flush(self) -> None:
        """Every stored block gone (the server's database emptied)."""
        self.client.flushdb()

    def pause(self, milliseconds: int) -> None:
        self.client.execute_command("CLIENT", "PAUSE", str(milliseconds), "ALL")

    def drop_connections(self) -> None:
        self.client.client_kill_filter(_type="normal", skipme=True)


class MooncakeControl(RemoteControl):
    kind = "Mooncake Store"
    can_pause = False
    can_drop_connections = False

    def __init__(self, url: str) -> None:
        parsed = urlsplit(url)
        metadata = parse_qs(parsed.query).get("metadata", [None])[0]
        if not parsed.hostname or not parsed.port or not metadata:
            raise InputError("--remote mooncake:// must be mooncake://HOST:RPC_PORT?metadata=http://HOST:PORT/metadata")
        self.master, self.metadata = f"{parsed.hostname}:{parsed.port}", metadata
        self._client = None

    def check(self) -> None:
        """The master and its metadata server listen. No client is made here: this runs in the
        parent of the forked scenario processes, and a Mooncake client's threads do not survive a
        fork (a child inheriting one hangs)."""
        from kvtool.connectors.mooncake_store import probe
        metadata = urlsplit(self.metadata)
        for host, port in (self.master.rsplit(":", 1), (metadata.hostname, metadata.port or 80)):
            try:
                probe(host, int(port))
            except OSError as exc:
                raise InputError(f"nothing answers at {host}:{port} ({exc})") from None

    def _connected(self):
        if self._client is None:
            from kvtool.connectors.mooncake_store import open_client
            from kvtool.connectors.remote_store import StoreUnavailable
            try:
                self._client = open_client("127.0.0.1", self.metadata, self.master)
            except StoreUnavailable as exc:
                raise InputError(str(exc)) from None
        return self._client

    def flush(self) -> None:
        self._connected().remove_all(True)    # forced: a key just read is leased


CONTROLS = {"redis": RedisControl, "rediss": RedisControl, "mooncake": MooncakeControl}


def remote_control(url: str) -> RemoteControl:
    """The control of the server `url` names (InputError for a kind kvtool cannot drive)."""
    scheme = urlsplit(url).scheme
    if scheme not in CONTROLS:
        raise InputError(f"--remote must start with {', '.join(f'{s}://' for s in CONTROLS)}, got {url!r}")
    return CONTROLS[scheme](url)
