"""A real prefill or decode worker process with test-only faults: `python -m tests.e2e.fault_worker ROLE ARGS...`.

The product has no fault hooks. This harness wraps two of the worker's own functions, then runs the worker's usual
`main(ARGS)`, so that a request whose id names a fault fails inside the worker the way a bug or a lost device would:

    fault-{role}-step...     `ModelRunner.execute` raises for a step that holds the request (the engine step fails:
                             every request in flight on that worker fails with it)
    fault-{role}-output...   the worker's output handler raises on the request's output

Every other request runs untouched. `FaultyLauncher` is `strata serve`'s launcher with its workers started so.
"""
from __future__ import annotations

import importlib
import sys

from engine.model_runner import ModelRunner
from prefill_worker.service import PrefillJob
from strata.launcher import LocalLauncher
from worker_common.streaming import StreamingRequest


class InjectedFault(RuntimeError):
    """Raised where a test asked for a fault."""


def install(role: str) -> None:
    step, output = f"fault-{role}-step", f"fault-{role}-output"
    execute = ModelRunner.execute

    def failing_execute(self, batch):
        if any(seq.request_id.startswith(step) for seq in batch.seqs):
            raise InjectedFault(f"injected fault in the engine step of {role}")
        return execute(self, batch)
    ModelRunner.execute = failing_execute

    for sink in (PrefillJob, StreamingRequest):
        def failing_on_output(self, out, now, _on_output=sink.on_output):
            if out.request_id.startswith(output):
                raise InjectedFault(f"injected fault in the output handler of {role}")
            return _on_output(self, out, now)
        sink.on_output = failing_on_output


class FaultyLauncher(LocalLauncher):
    """`strata serve`'s launcher, with every worker started under this harness."""

    def _spawn(self, name, role, module, args, ready):
        if role in ("prefill", "decode"):
            module, args = "tests.e2e.fault_worker", [role, *args]
        return super()._spawn(name, role, module, args, ready)


def main(argv: list[str]) -> None:
    role, args = argv[0], argv[1:]
    install(role)
    importlib.import_module(f"{role}_worker.__main__").main(args)


if __name__ == "__main__":
    main(sys.argv[1:])
