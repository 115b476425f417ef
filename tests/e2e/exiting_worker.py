"""A stand-in worker that fails during start-up: `python -m tests.e2e.exiting_worker CODE ARGS...`.

It starts a long-lived child of its own that keeps the worker's stdout open (as a compile or transfer helper
process might), prints why it fails, and exits with CODE before any READY line. The launcher must notice the exit
itself (the end of its output never comes while the child lives), fail at once, and leave no process behind.
`ExitingLauncher` is `strata serve`'s launcher with its workers started so.
"""
from __future__ import annotations

import subprocess
import sys

from strata.launcher import LocalLauncher


class ExitingLauncher(LocalLauncher):
    """Workers run this module (exit code `exit_code`); the router is the real one."""

    exit_code = 3

    def _spawn(self, name, role, module, args, ready):
        if role in ("prefill", "decode"):
            module, args = "tests.e2e.exiting_worker", [str(self.exit_code), *args]
        return super()._spawn(name, role, module, args, ready)


def main(argv: list[str]) -> None:
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # inherits stdout
    print(f"helper pid {helper.pid}", flush=True)
    print("error: this worker fails during start-up on purpose", file=sys.stderr, flush=True)
    sys.exit(int(argv[0]))


if __name__ == "__main__":
    main(sys.argv[1:])
