"""The tcp backend at an earlier commit against the working tree's, in the same run: one owner process serves one
region through both versions, the reader alternates between them (and a bare loopback socket and memcpy) in
interleaved rounds, and each figure is a median. For judging a change to the tcp transport on a noisy machine, where
two separate benchmark runs differ more than the change does.

    python benchmarks/transfer_ab.py --rev HEAD~1 [--quick] [--json]

With --json the last line printed is one JSON object holding every figure.

The earlier version's `tcp.py` and `tcp_server.py` are taken with `git show` into a temporary package and
registered as backend `tcp@REV`. A revision whose tcp backend needs other modules of its own time is not supported.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from transfer_bench import REGION_BYTES, SocketReference

KiB, MiB = 1 << 10, 1 << 20
CASES = [(1, 64 * KiB), (1, 256 * KiB), (1, MiB), (1, 4 * MiB), (1, 16 * MiB), (64, 256 * KiB), (16, MiB)]
ROOT = Path(__file__).resolve().parent.parent


def load_old(rev: str, into: str) -> str:
    """Write REV's tcp backend as modules `strata_old_tcp{,_server}` under `into`, register it; its backend name."""
    name = f"tcp@{rev}"
    files = {"strata_old_tcp_server": "kvstore/transfer/tcp_server.py", "strata_old_tcp": "kvstore/transfer/tcp.py"}
    for module, path in files.items():
        text = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout
        text = text.replace("from kvstore.transfer.tcp_server import", "from strata_old_tcp_server import")
        text = text.replace('@register_backend("tcp")', f"@register_backend({name!r})")
        Path(into, f"{module}.py").write_text(text)
    sys.path.insert(0, into)
    import strata_old_tcp  # noqa: F401  (registers the backend)
    return name


def owner_main(rev: str, into: str, conn) -> None:
    from kvstore.transfer import MemoryRegion, TransferConfig, create_agent

    backends = ["tcp", load_old(rev, into)]
    region = MemoryRegion.shared("ab", REGION_BYTES)
    np.frombuffer(region.buffer, np.uint8)[:] = np.random.default_rng(0).integers(0, 256, REGION_BYTES, np.uint8)
    agents = [create_agent(TransferConfig(backend=b)) for b in backends]
    # NOTE: each handle carries a lease over the whole region: a tcp owner serves leased ranges only
    conn.send({b: (*a.register(region), a.grant_lease("ab", [(0, REGION_BYTES)], 24 * 3600.0))
               for b, a in zip(backends, agents)})
    conn.recv()
    for agent in agents:
        agent.close()
    region.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rev", default="HEAD", help="the git revision whose tcp backend is the baseline")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="reads up to 1 MiB, one round, few loops (CI)")
    parser.add_argument("--json", action="store_true", help="print one JSON object with every figure last")
    args = parser.parse_args()
    cases, rounds, max_loops = (CASES[:3], 1, 20) if args.quick else (CASES, args.rounds, 2000)
    from kvstore.transfer import Descriptor, TransferConfig, create_agent, pack_views

    with tempfile.TemporaryDirectory() as into:
        old = load_old(args.rev, into)
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=owner_main, args=(args.rev, into, child), daemon=True)
        proc.start()
        handles = parent.recv()
        readers = {b: create_agent(TransferConfig(backend=b)) for b in handles}
        ref = SocketReference()
        print(f"us per read, medians of {rounds} interleaved rounds; last column: {old} time / tcp time")
        rows = {}
        try:
            for count, size in cases:
                total = count * size
                dst, src, base_dst = np.zeros(total, np.uint8), np.ones(total, np.uint8), np.zeros(total, np.uint8)
                fns = {"memcpy": lambda: np.copyto(base_dst, src), "socket": lambda: ref.read(memoryview(dst))}
                for backend, (agent, region_id, _, lease) in handles.items():
                    descs = [Descriptor(agent, region_id, i * size % (REGION_BYTES - size + 1), size, lease)
                             for i in range(count)]
                    fns[backend] = (lambda r, d, v: lambda: r.read(d, v, deadline_s=30.0))(
                        readers[backend], descs, pack_views(dst, descs))
                loops = max(3, min(max_loops, int(48 * MiB / total)))
                times = {k: [] for k in fns}
                for fn in fns.values():  # warm: connections made, pages touched
                    fn()
                for _ in range(rounds):
                    for k, fn in fns.items():
                        start = time.perf_counter()
                        for _ in range(loops):
                            fn()
                        times[k].append((time.perf_counter() - start) / loops * 1e6)
                med = {k: statistics.median(v) for k, v in times.items()}
                name = f"{count}x{size // KiB}KiB" if count > 1 else f"{size // KiB}KiB"
                rows[name] = {**{f"{k}_us": v for k, v in med.items()}, "speedup": med[old] / med["tcp"]}
                print(f"{name:>11s}: " + "  ".join(f"{k} {v:7.0f}" for k, v in med.items())
                      + f"   {med[old] / med['tcp']:.2f}x", flush=True)
        finally:
            for reader in readers.values():
                reader.close()
            ref.close()
            parent.send("stop")
            proc.join(10)
    if args.json:
        print(json.dumps({"benchmark": "transfer_ab", "rev": args.rev, "quick": args.quick, "results": rows}))


if __name__ == "__main__":
    main()
