"""`python -m decode_worker --model PATH --port N --transfer shm|tcp|nixl ...`: serve until SIGTERM/SIGINT
(`--expert-parallel N`: as a group of N ranks, `worker_common.ep_worker`)."""
from __future__ import annotations

import sys

from decode_worker.service import DecodeService
from worker_common.entrypoint import run_worker


def main(argv: list[str] | None = None) -> None:
    run_worker("decode", DecodeService, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
