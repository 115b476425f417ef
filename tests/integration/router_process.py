"""`python -m router` alone, as a process, until its READY line (tests that start a router without `strata serve`)."""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

from strata.launcher import REPO_ROOT


class RouterProcess:
    """Its READY line's addresses: `grpc_address`, `http_address` ("" without HTTP) and `registry_address` (where
    workers register: its --registry-port, else `grpc_address`)."""

    def __init__(self, args: list[str], ready_timeout_s: float = 120.0) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO_ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-m", "router", *args], cwd=REPO_ROOT, env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=lambda: [lines.put(line) for line in self.proc.stdout], daemon=True).start()
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise AssertionError("the router did not start:\n" + "".join(self.seen))
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
            self.seen.append(line)
            if line.startswith("READY "):
                fields = dict(part.split("=", 1) for part in line.split()[1:])
                self.grpc_address, self.http_address = fields["grpc"], fields["http"]
                self.registry_address = fields.get("registry") or self.grpc_address
                return

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
