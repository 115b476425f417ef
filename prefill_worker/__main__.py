"""`python -m prefill_worker --model PATH --port N --transfer shm|tcp|nixl ...`: serve until SIGTERM/SIGINT."""
from __future__ import annotations

import sys

from prefill_worker.service import PrefillService
from worker_common.cli import parse_config
from worker_common.server import run_until_signalled, serve


def main(argv: list[str] | None = None) -> None:
    service = PrefillService(parse_config("prefill", argv))
    server = serve(service, extra_ready=f"agent={service.agent.address}")
    run_until_signalled(service, server, service.close)


if __name__ == "__main__":
    main(sys.argv[1:])
