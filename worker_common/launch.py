"""Start a worker as a local process and wait for its READY line (tests, benchmarks, a local launcher).

    with WorkerProcess("prefill", ["--model", path, "--transfer", "shm"]) as prefill:
        stub = prefill.stub()
"""
from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Sequence

import grpc

from strata.v1 import worker_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parent.parent
READY = re.compile(r"^READY (\S+) role=(\w+) worker_id=(\S+) transfer=(\w+)(?: agent=(\S+))?"
                   r"(?: events=(\S*))?(?: replay=(\S*))?(?: metrics=(\S*))?")


class WorkerStartError(RuntimeError):
    """The worker exited or printed no READY line in time; the message carries the tail of its log."""


class WorkerProcess:
    def __init__(self, role: str, args: Sequence[str], ready_timeout_s: float = 180.0,
                 env: dict[str, str] | None = None, wait: bool = True) -> None:
        """`wait=False` returns once the process is spawned; call `wait_ready()` (start several in parallel)."""
        self.role = role
        self.log_path = Path(tempfile.mkstemp(prefix=f"strata-{role}-", suffix=".log")[1])
        self._log = self.log_path.open("w")
        environ = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), environ.get("PYTHONPATH")]))
        self.proc = subprocess.Popen([sys.executable, "-m", f"{role}_worker", *args], cwd=REPO_ROOT, env=environ,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.address = self.worker_id = self.agent_address = ""
        self.events_endpoint = self.replay_endpoint = ""     # the worker's KV-event PUB and replay sockets
        self.metrics_url = ""                                 # its /metrics, when started with --metrics-port
        self._channel: grpc.Channel | None = None
        self._ready_timeout_s = ready_timeout_s
        if wait:
            self.wait_ready()

    def wait_ready(self) -> WorkerProcess:
        if not self.address:
            (self.address, self.worker_id, self.agent_address, self.events_endpoint, self.replay_endpoint,
             self.metrics_url) = self._wait_ready(self._ready_timeout_s)
        return self

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _wait_ready(self, timeout_s: float) -> tuple[str, str, str, str, str, str]:
        # NOTE: the exit is noticed by polling, not only by the end of stdout: a process the worker started may
        # hold the pipe open after the worker itself is gone.
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=0.2)
            except queue.Empty:
                line = ""
            if line is None or (not line and not self.alive):
                raise WorkerStartError(f"{self.role} worker exited ({self.proc.wait()}):\n{self.log_tail()}")
            if match := READY.match(line):
                return (match.group(1), match.group(3), match.group(5) or "", match.group(6) or "",
                        match.group(7) or "", match.group(8) or "")
            if time.monotonic() > deadline:
                self.kill()
                raise WorkerStartError(f"{self.role} worker printed no READY line in {timeout_s}s:\n"
                                       f"{self.log_tail()}")

    def log_tail(self, num_chars: int = 4000) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()[-num_chars:]

    def stub(self) -> worker_pb2_grpc.WorkerStub:
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.address)
        return worker_pb2_grpc.WorkerStub(self._channel)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, timeout_s: float = 15.0) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self.alive:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
