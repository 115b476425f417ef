"""Real Redis and S3-compatible servers on free loopback ports, for tests, benchmarks and `strata serve` in dev.

    with RedisServer() as redis_srv, S3Server() as s3_srv:
        RedisTier(url=redis_srv.url); S3Tier(bucket="b", **s3_srv.client_options())

Each server is a child process (`redis-server`, moto's server) so a fault test can kill it hard and restart it
on the same port. Neither keeps data across a restart (Redis runs with `--save '' --appendonly no`; moto keeps its
buckets in memory). Nothing here is meant for production: it binds 127.0.0.1 only.
"""
from __future__ import annotations

import atexit
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

LOOPBACK = "127.0.0.1"


class DevServerError(RuntimeError):
    """A dev server did not start (missing binary, port taken, did not answer in time)."""


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
        return True


def free_port_with_bus(offset: int = 10_000, highest: int = 55_535) -> int:
    """A free loopback port `p <= highest` whose `p + offset` is free too: Redis Cluster listens on both (the bus
    port is the client port + 10000), and refuses a client port above 55535."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randint(20_000, highest)
        if _port_is_free(port) and _port_is_free(port + offset):
            return port
    raise DevServerError(f"no free loopback port pair (p, p+{offset}) with p <= {highest}")


class _ChildServer:
    """A server process on a fixed loopback port: start, wait until it answers, kill, restart on the same port."""

    kind = "server"

    def __init__(self, port: int | None, startup_timeout_s: float) -> None:
        self.port = port or free_port()
        self.startup_timeout_s = startup_timeout_s
        self.workdir = Path(tempfile.mkdtemp(prefix=f"strata-{self.kind.split()[0]}-"))
        self.log_path = self.workdir / "server.log"
        self._proc: subprocess.Popen | None = None

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _answers(self) -> bool:
        raise NotImplementedError

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self.running else None

    def start(self) -> "_ChildServer":
        if self.running:
            return self
        self.workdir.mkdir(parents=True, exist_ok=True)
        # NOTE: output goes to a file, never a pipe: a server logging every request would fill an unread pipe
        # and block (moto logs each HTTP request).
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(self._command(), stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        atexit.unregister(self.stop)
        atexit.register(self.stop)  # a safety net for an interpreter that exits without stopping us
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                tail = self.log_path.read_bytes()[-2000:].decode(errors="replace")
                raise DevServerError(f"{self.kind} on port {self.port} exited with {self._proc.returncode}: {tail}")
            if self._answers():
                return self
            time.sleep(0.05)
        self.kill()
        raise DevServerError(f"{self.kind} on port {self.port} did not answer within {self.startup_timeout_s}s")

    def kill(self) -> None:
        """SIGKILL the server (a crash, as a fault test wants it) and wait for it to be gone."""
        self._signal(signal.SIGKILL)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it does not exit within 5 s; the log and pidfile go with it."""
        self._signal(signal.SIGTERM)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def restart(self) -> "_ChildServer":
        self.kill()
        return self.start()

    def _signal(self, sig: int) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisServer(_ChildServer):
    """`redis-server` on 127.0.0.1:`port` with no persistence, its pidfile and working dir in a private temp dir."""

    kind = "redis-server"

    def __init__(self, port: int | None = None, *, executable: str | None = None,
                 startup_timeout_s: float = 10.0, extra_args: tuple[str, ...] = ()) -> None:
        if port is None and "--cluster-enabled" in extra_args:
            port = free_port_with_bus()
        super().__init__(port, startup_timeout_s)
        self.executable = executable or shutil.which("redis-server") or "/usr/bin/redis-server"
        if not os.path.exists(self.executable):
            raise DevServerError("redis-server not found: install it (apt-get install redis-server) "
                                 "or pass executable=")
        self.extra_args = extra_args

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    def _command(self) -> list[str]:
        return [self.executable, "--bind", LOOPBACK, "--port", str(self.port),
                "--pidfile", str(self.workdir / "redis.pid"), "--dir", str(self.workdir),
                "--save", "", "--appendonly", "no", "--daemonize", "no", *self.extra_args]

    def _answers(self) -> bool:
        try:
            with socket.create_connection((LOOPBACK, self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith((b"+PONG", b"-NOAUTH"))  # a server with requirepass answers too
        except OSError:
            return False



class S3Server(_ChildServer):
    """moto's S3-compatible HTTP server (`python -m moto.server`) on 127.0.0.1:`port`; any credentials work."""

    kind = "moto S3 server"
    region = "us-east-1"
    access_key = "strata-dev"
    secret_key = "strata-dev-secret"

    def __init__(self, port: int | None = None, *, startup_timeout_s: float = 30.0) -> None:
        super().__init__(port, startup_timeout_s)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def client_options(self) -> dict[str, str]:
        """Keyword options for `S3Tier` (and, renamed, for boto3) that reach this server."""
        return {"endpoint_url": self.url, "region": self.region,
                "aws_access_key_id": self.access_key, "aws_secret_access_key": self.secret_key}

    def _command(self) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", LOOPBACK, "-p", str(self.port)]

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/moto-api/", timeout=0.5):
                return True
        except urllib.error.HTTPError:
            return True  # it answered, whatever the status
        except OSError:
            return False
