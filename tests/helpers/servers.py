"""Real servers for tests: started on 127.0.0.1 on a free port with no persistence, waited for,
stopped by their pid. Nothing relies on a system service."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import weakref

import pytest


def reserve_port() -> socket.socket:
    """A socket bound to a free port of 127.0.0.1 with SO_REUSEADDR, never listening, held open for
    as long as a server may use the port. While it is open the kernel gives the port to no other
    bind(0) or outgoing connection (another pytest-xdist worker's server cannot take it between the
    choice and the server's bind, nor while a killed server is restarted), a connection to it is
    refused, and a server that sets SO_REUSEADDR itself (redis-server, Mooncake) binds and listens on it."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    return s


def port_of(reservation: socket.socket) -> int:
    return reservation.getsockname()[1]


def _close_all(reservations: list[socket.socket]) -> None:
    for reservation in reservations:
        reservation.close()


def _wait_for_port(port: int, process: subprocess.Popen, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server on port {port} exited with {process.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.02)
    raise RuntimeError(f"server on port {port} did not listen within {timeout} s")


def stop_process(process: subprocess.Popen | None) -> None:
    """SIGTERM, and SIGKILL when it has not exited 10 s later."""
    if process and process.poll() is None:
        os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()


class RedisServer:
    """One redis-server process; `kill` and `start` again give a server restarted empty."""

    def __init__(self, *extra: str) -> None:
        reservation = reserve_port()     # held until `stop` (or until this object goes): a restart finds the port free
        self._release = weakref.finalize(self, _close_all, [reservation])
        self.port = port_of(reservation)
        self.extra = extra
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.process = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
             "--protected-mode", "yes", *self.extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_for_port(self.port, self.process)
        return self

    def kill(self) -> None:
        """SIGKILL: what a crashed server looks like to its clients."""
        if self.process and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        stop_process(self.process)
        self._release()

    def client(self):
        import redis
        return redis.Redis(host="127.0.0.1", port=self.port)


def need_redis() -> None:
    """Skip, saying why, where redis-server or the client cannot be had."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    pytest.importorskip("redis", reason="the redis client is not installed (pip install 'kvtool[redis]')")


def mooncake_binary(name: str) -> str | None:
    """A Mooncake program installed with the wheel (beside this Python) or on PATH."""
    import sys
    from pathlib import Path
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


class MooncakeStore:
    """A Mooncake master (RPC and HTTP metadata on 127.0.0.1) and one `mooncake_client` holding the
    pool. Only run inside a private network namespace: the master's listeners bind every interface."""

    def __init__(self, segment: str = "256MB") -> None:
        reservations = [reserve_port() for _ in range(4)]     # held until `stop` (or until this object goes)
        self._release = weakref.finalize(self, _close_all, reservations)
        self.rpc_port, self.http_port, self.metrics_port, self.client_port = map(port_of, reservations)
        self.segment = segment
        self.master: subprocess.Popen | None = None
        self.pool: subprocess.Popen | None = None

    @property
    def options(self) -> dict[str, str]:
        return {"master": f"127.0.0.1:{self.rpc_port}", "metadata": f"http://127.0.0.1:{self.http_port}/metadata"}

    def start(self) -> MooncakeStore:
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        self.master = subprocess.Popen(
            [mooncake_binary("mooncake_master"), f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
             "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={self.http_port}", f"--metrics_port={self.metrics_port}"], **quiet)
        _wait_for_port(self.rpc_port, self.master)
        _wait_for_port(self.http_port, self.master)
        self.pool = subprocess.Popen(
            [mooncake_binary("mooncake_client"), "--host=127.0.0.1", f"--port={self.client_port}",
             f"--global_segment_size={self.segment}", f"--master_server_address=127.0.0.1:{self.rpc_port}",
             f"--metadata_server=http://127.0.0.1:{self.http_port}/metadata"], **quiet,
            env={**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"})
        _wait_for_port(self.client_port, self.pool)
        time.sleep(0.5)     # the pool's segment is mounted just after its service listens
        return self

    def kill_master(self) -> None:
        if self.master and self.master.poll() is None:
            os.kill(self.master.pid, signal.SIGKILL)
            self.master.wait()

    def stop(self) -> None:
        for process in (self.pool, self.master):
            stop_process(process)
        self._release()

    def client(self):
        """A raw Mooncake client (segment 0) for tests that tamper with the store."""
        from kvtool.connectors.mooncake_store import open_client
        return open_client("127.0.0.1", self.options["metadata"], self.options["master"])


class CuttingProxy:
    """A TCP proxy to 127.0.0.1:`port` that, once armed, cuts the connection carrying the
    `cut_after`-th byte from the server to the client: a connection dropped in the middle of a
    reply. Later connections pass untouched."""

    def __init__(self, port: int, cut_after: int) -> None:
        import threading
        self.target, self.cut_after = port, cut_after
        self.armed = False
        self.num_cuts = 0
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        import threading
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, to_client: bool) -> None:
        sent = 0
        try:
            while data := source.recv(65536):
                if to_client and self.armed and sent + len(data) >= self.cut_after:
                    sink.sendall(data[:max(self.cut_after - sent, 1)])
                    self.armed = False
                    self.num_cuts += 1
                    break
                sink.sendall(data)
                sent += len(data) if self.armed else 0
        except OSError:
            pass
        for s in (source, sink):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self._listener.close()
