"""`strata serve` fails fast (issue: the launcher waited 300 s for a READY line from a worker that had exited after
7 s): a part that exits during start-up ends the launch at once with its exit code and the last lines of its
output, and no process is left running; a bad `--s3-url` is refused while parsing, before anything starts.

Bounds are generous (a loaded 2-core machine): "at once" is well under the 300 s start timeout, not a race."""
from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from strata.launcher import REPO_ROOT, LaunchError, LocalLauncher, ServeConfig
from tests.e2e.exiting_worker import ExitingLauncher

pytestmark = pytest.mark.slow

FAST_S = 60.0          # the start timeout stays 300 s; a failed start must end far sooner
BAD_S3_URL = "http://127.0.0.1:9000/kv"   # a 2-character bucket: S3 wants 3 to 63


def make_config(**fields) -> ServeConfig:
    return ServeConfig(prefill=1, decode=1, grpc_port=0, http_port=-1, num_blocks=64, host_tier_mib=8,
                       handoff_mib=8, **fields)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie nobody reaped yet is dead for this purpose
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def wait_all_dead(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if pid_alive(p)]


def start_and_fail(launcher: LocalLauncher) -> tuple[LaunchError, float]:
    started = time.monotonic()
    with pytest.raises(LaunchError) as err:
        launcher.start()   # stops what it started before raising
    return err.value, time.monotonic() - started


def test_a_worker_that_exits_during_start_up_ends_the_launch_at_once_with_its_code_and_output():
    """A real worker given an option only it knows to refuse: argparse's exit 2 and its message."""
    launcher = LocalLauncher(make_config(worker_args=("--no-such-option",)), log=io.StringIO())
    error, took = start_and_fail(launcher)
    assert took < FAST_S, f"the failed start took {took:.0f}s"
    assert error.part in ("prefill-0", "decode-0") and error.exit_code == 2
    assert "exited with code 2 during start-up" in str(error)
    assert "unrecognized arguments: --no-such-option" in str(error)
    assert wait_all_dead([c.proc.pid for c in launcher.children]) == []


def test_an_exit_is_noticed_while_a_child_of_the_worker_holds_its_output_open():
    """The worker exits (code 3) but a process it started keeps the pipe open, so its output never ends: the
    launcher still fails at once, and stopping takes the helper down with the worker's process group."""
    log = io.StringIO()
    launcher = ExitingLauncher(make_config(), log=log)
    error, took = start_and_fail(launcher)
    assert took < FAST_S, f"the failed start took {took:.0f}s"
    assert error.exit_code == 3 and "fails during start-up on purpose" in str(error)
    helpers = [int(p) for p in re.findall(r"helper pid (\d+)", log.getvalue())]
    assert helpers, log.getvalue()
    assert wait_all_dead([c.proc.pid for c in launcher.children] + helpers) == []


def run_serve(args: list[str], timeout_s: float = 180) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "strata.cli", "serve", *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=REPO_ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return done, time.monotonic() - started


def test_strata_serve_exits_with_the_failed_workers_code_and_leaves_no_process(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("serve:\n  grpc-port: 0\n  http-port: -1\n  num_blocks: 64\n  host_tier_mib: 8\n"
                      "  handoff_mib: 8\n  worker_args: [--no-such-option]\n")
    done, took = run_serve(["--config", str(config)])
    assert took < FAST_S, f"strata serve took {took:.0f}s to fail"
    assert done.returncode == 2, done.stderr
    assert "exited with code 2 during start-up" in done.stderr
    assert "unrecognized arguments: --no-such-option" in done.stderr
    pids = [int(p) for p in re.findall(r"started \S+ \(pid (\d+)\)", done.stderr)]
    assert len(pids) == 3 and wait_all_dead(pids) == []


def test_ctrl_c_while_starting_stops_strata_serve_at_once(tmp_path):
    """Children lead their own process groups (so stopping reaches what they start): a terminal's Ctrl-C reaches
    only `strata serve`, which must then stop the start in progress, not wait for every part to come up."""
    proc = subprocess.Popen([sys.executable, "-m", "strata.cli", "serve", "--grpc-port", "0", "--http-port", "-1",
                             "--no-disk"], cwd=REPO_ROOT, text=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    seen: list[str] = []
    try:
        for line in proc.stderr:
            seen.append(line)
            if "started decode-0" in line:
                break
        proc.send_signal(signal.SIGINT)
        started = time.monotonic()
        seen += proc.stderr.readlines()
        assert proc.wait(timeout=FAST_S) == 1
        assert time.monotonic() - started < FAST_S
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(seen)
    assert "interrupted while starting" in text
    pids = [int(p) for p in re.findall(r"started \S+ \(pid (\d+)\)", text)]
    assert len(pids) == 3 and wait_all_dead(pids) == []


def test_strata_serve_refuses_a_bad_s3_url_before_starting_anything():
    done, took = run_serve(["--s3-url", BAD_S3_URL], timeout_s=60)
    assert done.returncode == 2
    message = " ".join(done.stderr.replace("│", " ").split())  # rich's error box, unwrapped
    assert "--s3-url" in message and "3 to 63 characters" in message and "'kv'" in message
    assert "started" not in done.stderr


def test_strata_serve_refuses_a_bad_s3_url_from_its_config_file(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text(f"serve:\n  s3-url: {BAD_S3_URL}\n")
    done, _ = run_serve(["--config", str(config)], timeout_s=60)
    assert done.returncode == 2
    assert "error: --s3-url names bucket 'kv'" in done.stderr and "started" not in done.stderr


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_worker_refuses_a_bad_s3_url_while_parsing_its_arguments(role):
    done = subprocess.run([sys.executable, "-m", f"{role}_worker", "--s3-url", BAD_S3_URL], capture_output=True,
                          text=True, timeout=120, cwd=REPO_ROOT)
    assert done.returncode == 2
    assert "argument --s3-url: names bucket 'kv'" in done.stderr and "3 to 63 characters" in done.stderr
