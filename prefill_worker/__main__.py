"""`python -m prefill_worker --model PATH --port N --transfer shm|tcp|nixl ...`: serve until SIGTERM/SIGINT
(`--expert-parallel N`: as a group of N ranks, `worker_common.ep_worker`)."""
from __future__ import annotations

import sys

from prefill_worker.service import PrefillService
from worker_common.entrypoint import run_worker


def main(argv: list[str] | None = None) -> None:
    run_worker("prefill", PrefillService, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
