"""Put and get bandwidth of each KV-store tier, as a ratio against the raw baseline measured in the same run.

    python benchmarks/kvstore_bench.py                      # host,disk,seal; 64 KiB, 1 MiB, 16 MiB blocks
    python benchmarks/kvstore_bench.py --tiers seal --sizes 64KiB --rounds 15   # encryption at rest alone
    python benchmarks/kvstore_bench.py --tiers host,disk,redis,s3 --quick --json

Baselines: memcpy between preallocated buffers (host), a plain file write / readinto per block (disk), redis-py
SET / GET of the same bytes (redis), boto3 put_object / get_object (s3). Redis and S3 run as local servers started
by `strata.devservers`. The `seal` part is the cost of encryption at rest (kvstore/sealing.py, AES-256-GCM): "put"
seals each block, "get" opens it back into a preallocated buffer, both against a memcpy of the same bytes; its
ratios are the sealer's share of memcpy's bandwidth (1/ratio = how many memcpys one seal or open costs).
Tier and baseline run back to back in each round (order alternating); a ratio is the median of the per-round ratios
and a bandwidth the median over rounds. The last line with `--json` is one JSON object holding every figure.
Target: ratio >= 0.8 at 1 MiB (the tiers; the seal part has no target: it is a cost to know).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvstore import codec  # noqa: E402
from kvstore.hashing import Namespace, hash_blocks  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
SIZES = {"64KiB": 64 * KiB, "1MiB": MiB, "16MiB": 16 * MiB}
NS = Namespace("bench@kvstore", "bench-layout", "float16")


def make_blocks(payload_bytes: int, count: int) -> tuple[list[bytes], list[bytes]]:
    """`count` encoded blocks whose payload is `payload_bytes` (fp16, 16 tokens, 8 heads x 128 dims per layer)."""
    layout = codec.BlockLayout(num_layers=payload_bytes // (64 * KiB), block_size=16, kv_heads=8, head_dim=128)
    tokens = list(range(16 * count))
    hashes = hash_blocks(NS, tokens, 16)
    payload = os.urandom(payload_bytes)
    fp = NS.fingerprint()
    return hashes, [codec.encode(fp, h, layout, "float16", payload, tokens=tokens[16 * i:16 * i + 16])
                    for i, h in enumerate(hashes)]


def timed(fn: Callable[[], None]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


class Bench:
    """One tier's put/get against its baseline. Subclasses set `self.tier`, the two `base_*` operations and `reset`
    between rounds; `put` / `get` / `close` are the tier's, one block per call."""

    tier: Any

    def __init__(self, hashes: list[bytes], blocks: list[bytes]) -> None:
        self.hashes, self.blocks = hashes, blocks
        self.bufs = [memoryview(bytearray(len(b))) for b in blocks]  # preallocated, touched once
        for buf in self.bufs:
            buf[:] = b"\x00" * len(buf)

    def reset(self) -> None:
        """Make the next put round write fresh objects (outside the timing)."""

    def run(self, rounds: int) -> dict:
        """Per round, tier and baseline back to back (order alternating); the ratio is the median of the per-round
        ratios, which a busy shared machine disturbs far less than a ratio of two separate bests."""
        total = sum(len(b) for b in self.blocks)
        rates: dict[str, list[float]] = {k: [] for k in ("put", "get", "base_put", "base_get")}
        for i in range(rounds):
            self.reset()
            for op in ("put", "get"):
                pair = [(op, getattr(self, op)), (f"base_{op}", getattr(self, f"base_{op}"))]
                for name, fn in (pair if i % 2 else pair[::-1]):
                    rates[name].append(total / timed(fn))
        out = {}
        for op in ("put", "get"):
            out[f"{op}_ratio"] = statistics.median(t / b for t, b in zip(rates[op], rates[f"base_{op}"]))
            out[f"{op}_GBps"] = statistics.median(rates[op]) / 1e9
            out[f"base_{op}_GBps"] = statistics.median(rates[f"base_{op}"]) / 1e9
        return out

    def put(self) -> None:
        for h, b in zip(self.hashes, self.blocks):
            self.tier.put([(h, b)])

    def get(self) -> None:
        for h, buf in zip(self.hashes, self.bufs):
            self.tier.get([h], [buf])

    def close(self) -> None:
        self.tier.close()


class HostBench(Bench):
    def __init__(self, hashes, blocks) -> None:
        super().__init__(hashes, blocks)
        from kvstore.tiers.host import HostTier
        slot = -(-len(blocks[0]) // 4096) * 4096
        self.tier = HostTier(capacity_bytes=slot * len(blocks), slot_bytes=slot)
        self.dst = [memoryview(bytearray(slot)) for _ in blocks]  # the baseline's "slots"
        for d in self.dst:
            d[:] = b"\x01" * len(d)
        self.tier.put(list(zip(hashes, blocks)))  # fault the shared pages in once, as a running tier has
        self.src = [memoryview(b) for b in blocks]

    def reset(self) -> None:
        self.tier.clear()

    def put(self) -> None:
        for h, b in zip(self.hashes, self.src):
            self.tier.put([(h, b)])

    def base_put(self) -> None:
        for d, b in zip(self.dst, self.src):
            d[:len(b)] = b

    def base_get(self) -> None:
        for d, buf in zip(self.dst, self.bufs):
            buf[:] = d[:len(buf)]


class StoreBench(HostBench):
    """The whole TieredStore over host: `put` checks the header, `get` verifies the codec (xxh3 of the payload).

    Informational: it shows what verification costs on top of the host tier's copy; the target is per tier.
    """

    def __init__(self, hashes, blocks) -> None:
        super().__init__(hashes, blocks)
        from kvstore.config import HostTierConfig, StoreConfig
        from kvstore.store import TieredStore
        self.tier.close()
        self.store = TieredStore(StoreConfig(host=HostTierConfig(capacity_bytes=self.tier.capacity_bytes,
                                                                 slot_bytes=self.tier.slot_bytes)))
        self.tier = self.store.host
        self.fp = NS.fingerprint()
        self.tier.put(list(zip(hashes, blocks)))

    def put(self) -> None:
        for h, b in zip(self.hashes, self.src):
            self.store.put([(h, b)])

    def get(self) -> None:
        for h, buf in zip(self.hashes, self.bufs):
            self.store.get([h], [buf], self.fp)

    def close(self) -> None:
        self.store.close()


class DiskBench(Bench):
    def __init__(self, hashes, blocks, root: str) -> None:
        super().__init__(hashes, blocks)
        from kvstore.tiers.disk import DiskTier
        self.root = root
        self.tier = DiskTier(os.path.join(root, "tier"), capacity_bytes=2 * sum(len(b) for b in blocks))
        # The baseline writes plain files in the same sharded layout, so the ratio isolates what the tier adds
        # (temp file + rename for atomicity, the index, the LRU).
        self.raw = os.path.join(root, "raw")
        self.paths = [os.path.join(self.raw, h.hex()[:2], h.hex()) for h in hashes]
        for p in self.paths:
            os.makedirs(os.path.dirname(p), exist_ok=True)

    def reset(self) -> None:
        self.tier.clear()
        for p in self.paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)

    def base_put(self) -> None:
        for p, b in zip(self.paths, self.blocks):
            with open(p, "wb", buffering=0) as f:
                f.write(b)

    def base_get(self) -> None:
        for p, buf in zip(self.paths, self.bufs):
            with open(p, "rb", buffering=0) as f:
                f.readinto(buf)


class RedisBench(Bench):
    def __init__(self, hashes, blocks, url: str) -> None:
        super().__init__(hashes, blocks)
        import redis
        from kvstore.tiers.redis import RedisTier
        self.tier = RedisTier(url=url, key_prefix="bench:tier")
        self.client = redis.Redis.from_url(url)
        self.raw_keys = [b"bench:raw:" + h.hex().encode() for h in hashes]

    def reset(self) -> None:
        self.tier.clear()
        self.client.delete(*self.raw_keys)

    def base_put(self) -> None:
        for k, b in zip(self.raw_keys, self.blocks):
            self.client.set(k, b)

    def base_get(self) -> None:
        for k in self.raw_keys:
            self.client.get(k)

    def close(self) -> None:
        self.tier.close()
        self.client.close()


class S3Bench(Bench):
    def __init__(self, hashes, blocks, options: dict) -> None:
        super().__init__(hashes, blocks)
        import boto3
        from botocore.config import Config
        from kvstore.tiers.s3 import S3Tier
        # moto is slow on a busy machine: generous read timeouts on both sides, so neither measures a retry.
        self.tier = S3Tier(bucket="bench-tier", create_bucket=True, read_timeout_s=120.0, **options)
        self.client = boto3.client("s3", endpoint_url=options["endpoint_url"], region_name=options["region"],
                                   aws_access_key_id=options["aws_access_key_id"],
                                   aws_secret_access_key=options["aws_secret_access_key"],
                                   config=Config(read_timeout=120, retries={"max_attempts": 1}))
        self.client.create_bucket(Bucket="bench-raw")
        self.raw_keys = [f"raw/{h.hex()}" for h in hashes]

    def reset(self) -> None:
        self.tier.clear()
        for k in self.raw_keys:
            self.client.delete_object(Bucket="bench-raw", Key=k)

    def base_put(self) -> None:
        for k, b in zip(self.raw_keys, self.blocks):
            self.client.put_object(Bucket="bench-raw", Key=k, Body=b)

    def base_get(self) -> None:
        for k in self.raw_keys:
            self.client.get_object(Bucket="bench-raw", Key=k)["Body"].read()


class SealBench(Bench):
    """Sealing and opening (AES-256-GCM, a fresh nonce per block, as `SealedTier` does) against a memcpy of the
    same bytes between preallocated buffers. No tier: `put` / `get` are the sealer's (get opens objects sealed once,
    up front, straight into the preallocated buffers); `close` checks that every opened block is the original."""

    def __init__(self, hashes, blocks) -> None:
        super().__init__(hashes, blocks)
        from kvstore.sealing import Sealer
        self.sealer = Sealer(os.urandom(32))
        self.src = [memoryview(b) for b in blocks]
        self.dst = [memoryview(bytearray(len(b))) for b in blocks]  # the baseline's copies, touched once
        for d in self.dst:
            d[:] = b"\x01" * len(d)
        self.sealed = [self.sealer.seal(h, b) for h, b in zip(hashes, blocks)]

    def put(self) -> None:
        # NOTE: each sealed object is dropped at once, as `SealedTier.put` hands it to its tier and lets it go;
        # keeping a round's objects alive would time the allocator's fresh pages rather than the sealer.
        for h, b in zip(self.hashes, self.src):
            self.sealer.seal(h, b)

    def get(self) -> None:
        for h, obj, buf in zip(self.hashes, self.sealed, self.bufs):
            self.sealer.open_into(h, obj, buf)

    def base_put(self) -> None:
        for d, b in zip(self.dst, self.src):
            d[:] = b

    def base_get(self) -> None:
        for d, buf in zip(self.dst, self.bufs):
            buf[:] = d

    def close(self) -> None:
        assert all(bytes(buf) == b for buf, b in zip(self.bufs, self.blocks)), "an opened block differs"


def block_count(size: int, quick: bool, tier: str) -> int:
    budget = (8 if quick else 64) * MiB if tier in ("redis", "s3") else (32 if quick else 256) * MiB
    return max(2 if quick else 4, min(256, budget // size))


def bench_tier(tier: str, size: int, args: argparse.Namespace, servers: dict, root: str) -> dict:
    hashes, blocks = make_blocks(size, block_count(size, args.quick, tier))
    if tier == "host":
        bench = HostBench(hashes, blocks)
    elif tier == "store":
        bench = StoreBench(hashes, blocks)
    elif tier == "disk":
        bench = DiskBench(hashes, blocks, root)
    elif tier == "seal":
        bench = SealBench(hashes, blocks)
    elif tier == "redis":
        bench = RedisBench(hashes, blocks, servers["redis"].url)
    else:
        bench = S3Bench(hashes, blocks, servers["s3"].client_options())
    try:
        result = bench.run(args.rounds or (3 if args.quick else 9))
    finally:
        bench.close()
    result["blocks"] = len(blocks)
    return result


@contextlib.contextmanager
def servers_for(tiers: list[str]):
    running: dict = {}
    with contextlib.ExitStack() as stack:
        if "redis" in tiers or "s3" in tiers:
            from strata import devservers
            if "redis" in tiers:
                running["redis"] = stack.enter_context(devservers.RedisServer())
            if "s3" in tiers:
                running["s3"] = stack.enter_context(devservers.S3Server())
        yield running


def seal_line(size: str, r: dict) -> str:
    return (f"seal   {size:>6s}  seal {r['put_GBps'] * 1e3:8.1f} MB/s = {r['put_ratio']:.2f}x memcpy "
            f"({r['base_put_GBps'] * 1e3:.1f}; {1 / r['put_ratio']:.1f} memcpys)   open {r['get_GBps'] * 1e3:8.1f} "
            f"MB/s = {r['get_ratio']:.2f}x memcpy ({r['base_get_GBps'] * 1e3:.1f}; {1 / r['get_ratio']:.1f} memcpys)")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiers", default="host,disk,seal",
                        help="comma-separated: host,disk,redis,s3 (and store: the TieredStore over host, verifying; "
                             "seal: AES-GCM seal/open against memcpy)")
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, from {list(SIZES)}")
    parser.add_argument("--quick", action="store_true", help="few small rounds: checks that it works (CI)")
    parser.add_argument("--rounds", type=int, default=0, help="rounds per figure (best is kept)")
    parser.add_argument("--dir", default="", help="directory for the disk tier (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print one JSON object with every figure last")
    args = parser.parse_args(argv)
    tiers = [t for t in args.tiers.split(",") if t]
    sizes = [s for s in args.sizes.split(",") if s]
    for name in tiers + sizes:
        if name not in ("host", "disk", "redis", "s3", "store", "seal", *SIZES):
            parser.error(f"unknown tier or size {name!r}")
    root = tempfile.mkdtemp(prefix="strata-kvbench-", dir=args.dir or None)
    results: dict = {}
    try:
        with servers_for(tiers) as servers:
            for tier in tiers:
                for size in sizes:
                    r = bench_tier(tier, SIZES[size], args, servers, root)
                    results.setdefault(tier, {})[size] = r
                    if tier == "seal":
                        print(seal_line(size, r), flush=True)
                        continue
                    print(f"{tier:6s} {size:>6s}  put {r['put_GBps'] * 1e3:8.1f} MB/s = {r['put_ratio']:.2f}x raw "
                          f"({r['base_put_GBps'] * 1e3:.1f})   get {r['get_GBps'] * 1e3:8.1f} MB/s = "
                          f"{r['get_ratio']:.2f}x raw ({r['base_get_GBps'] * 1e3:.1f})", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary = {"benchmark": "kvstore", "quick": args.quick, "target_ratio_1MiB": 0.8, "results": results}
    if args.json:
        print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
