"""`python -m decode_worker --model PATH --port N --transfer shm|tcp|nixl ...`: serve until SIGTERM/SIGINT."""
from __future__ import annotations

import sys

from decode_worker.service import DecodeService
from worker_common.cli import parse_config
from worker_common.server import run_until_signalled, serve


def main(argv: list[str] | None = None) -> None:
    service = DecodeService(parse_config("decode", argv))
    server = serve(service, extra_ready=f"agent={service.agent.address}")
    run_until_signalled(service, server, service.close)


if __name__ == "__main__":
    main(sys.argv[1:])
