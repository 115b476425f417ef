"""`python -m prefill_worker ...` / `python -m decode_worker ...`: parse the flags, serve until SIGTERM/SIGINT.

A plain worker (`--expert-parallel 1`, the default) serves in this process. With `--expert-parallel N` this process
is one rank of a group (`worker_common.ep_worker`): rank 0 starts the others and serves the group's front.
"""
from __future__ import annotations

import logging
import os
import sys
import traceback
from typing import Sequence

from worker_common.cli import parse_config
from worker_common.server import WorkerBase, run_until_signalled, serve


def run_worker(role: str, service_type: type[WorkerBase], argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    config = parse_config(role, argv)
    if config.expert_parallel == 1:
        service = service_type(config)
        server = serve(service, extra_ready=f"agent={service.agent.address}")
        run_until_signalled(service, server, service.close)
        return
    from worker_common.ep_worker import run_rank

    try:
        code = run_rank(role, service_type, argv, config)
    except BaseException:  # noqa: BLE001 - reported here: the exit below skips the interpreter's own report
        traceback.print_exc()
        code = 1
    # NOTE: a broken collective may leave a thread blocked in the group's transport, which the interpreter's
    # shutdown would wait on; everything is closed and flushed by now, so leave at once with the status.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
