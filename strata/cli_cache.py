"""Operator commands (issue 5 item 7): `strata cache stats|evict|flush` and `strata workers`.

Each talks to the router's gRPC API (`--router`, or `STRATA_ROUTER`, default 127.0.0.1:50051), with `--api-key` (or
`STRATA_API_KEY`) when the router has API keys, and `--ca-file` (or `STRATA_CA_FILE`) when its gRPC port speaks TLS
(`--tls-*`, or fleet TLS: then the fleet CA).

    strata cache stats [--worker W] [--tier T] [--json] [--watch SECONDS]
    strata cache evict [--worker W] [--tier T] (--bytes N | --hash HEX ... | --hashes-from FILE) [--demote]
    strata cache flush [--worker W] [--tier T] [--yes]
    strata workers [--role prefill|decode] [--all] [--json]

Evict and flush on a shared tier (redis, s3) act once, through one worker (the result names it, `shared`), not once
per worker. Their deadline grows with the number of hashes (`--timeout` overrides it).
"""
from __future__ import annotations

import json
import sys
import time
from typing import Any, Iterable, Optional

import typer

cache_app = typer.Typer(help="Inspect and administer the KV-cache tiers of every worker.", no_args_is_help=True,
                        add_completion=False)

_ROUTER_HELP = "router gRPC address (default: $STRATA_ROUTER or 127.0.0.1:50051)"
_API_KEY_HELP = "the router's API key, when it has any (default: $STRATA_API_KEY)"
_CA_FILE_HELP = "dial the router over TLS, verifying it against this PEM CA (default: $STRATA_CA_FILE; else plain)"
_STATES = {0: "unspecified", 1: "ready", 2: "draining", 3: "dead"}
_ROLES = {0: "unspecified", 1: "prefill", 2: "decode", 3: "both"}


def _console():
    from rich.console import Console
    # NOTE: piped output would be cut to 80 columns; a log or a pager can take the whole table.
    return Console() if sys.stdout.isatty() else Console(width=200)


_TIMEOUT_HELP = "deadline in seconds (default: {})"
FLUSH_TIMEOUT_S = 300.0


def evict_timeout_s(num_hashes: int) -> float:
    """EvictCache's deadline: a minute (the device tier waits for the engine thread), plus 20 ms a hash (a
    remote tier's round trips, S3 the slowest; 2,000 hashes: 100 s)."""
    return 60.0 + 0.02 * num_hashes


def _client(router: Optional[str], timeout_s: float = 10.0, api_key: Optional[str] = None,
            ca_file: Optional[str] = None):
    """A client of the router; a CA file that cannot be read is a usage error (exit 2) naming the option."""
    from strata.client import StrataClient
    try:
        return StrataClient(router, timeout_s=timeout_s, api_key=api_key, ca_file=ca_file)
    except ValueError as exc:
        typer.echo(f"error: {str(exc).replace('ca_file', '--ca-file', 1)}", err=True)
        raise typer.Exit(2)


def _fail(exc: Exception, router: Optional[str]) -> None:
    import grpc
    from strata.client import default_address

    if isinstance(exc, grpc.RpcError):
        where = router or default_address()
        hint = {grpc.StatusCode.UNAVAILABLE: " (is `strata serve` running? over TLS: pass --ca-file)",
                grpc.StatusCode.UNAUTHENTICATED: " (pass --api-key or set STRATA_API_KEY)"}.get(exc.code(), "")
        typer.echo(f"error: {exc.code().name} from the router at {where}{hint}: {exc.details()}", err=True)
        raise typer.Exit(1)
    raise exc


# ------------------------------------------------------------------------------------------------ stats

def _rate(hits: int, misses: int) -> float | None:
    return hits / (hits + misses) if hits + misses else None


def tier_dict(tier) -> dict[str, Any]:
    """One tier's counters as JSON: every field of CacheTierStats, plus the two hit rates."""
    from google.protobuf.json_format import MessageToDict

    out = MessageToDict(tier, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    for key, value in list(out.items()):
        if isinstance(value, str) and value.isdigit() and key != "tier":
            out[key] = int(value)  # proto3 JSON writes uint64 as strings; operators' tools want numbers
    out["hit_rate_blocks"] = _rate(tier.hit_blocks, tier.miss_blocks)
    out["hit_rate_tokens"] = _rate(tier.hit_tokens, tier.miss_tokens)
    return out


def stats_dict(workers: Iterable, router: str) -> dict[str, Any]:
    rows = []
    totals = {k: 0 for k in ("hit_blocks", "miss_blocks", "hit_tokens", "miss_tokens", "bytes_read",
                             "bytes_written", "evictions", "promotions", "errors", "dropped", "quota_refused")}
    for w in workers:
        tiers = [tier_dict(t) for t in w.tiers]
        for t in tiers:
            for k in totals:
                totals[k] += t[k]
        rows.append({"worker_id": w.worker_id, "error": w.error, "collected_at_unix_ms": w.collected_at_unix_ms,
                     "pending_writes": w.pending_writes, "tiers": tiers})
    totals["pending_writes"] = sum(r["pending_writes"] for r in rows)
    totals["hit_rate_blocks"] = _rate(totals["hit_blocks"], totals["miss_blocks"])
    totals["hit_rate_tokens"] = _rate(totals["hit_tokens"], totals["miss_tokens"])
    return {"router": router, "workers": rows, "totals": totals}


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _pct(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.1%}"


def stats_table(data: dict[str, Any]):
    from rich.table import Table

    pending = ", ".join(f"{w['worker_id']} {w['pending_writes']}" for w in data["workers"] if not w["error"])
    table = Table(title=f"KV cache tiers (router {data['router']})", title_justify="left",
                  caption=f"pending background writes: {pending or '-'}", caption_justify="left")
    columns = ("worker", "tier", "capacity", "used", "blocks", "hit% blk", "hit% tok", "in", "out", "evict",
               "promo", "errors", "dropped", "quota refused", "get p50/p99 ms", "put p50/p99 ms", "healthy")
    for col in columns:
        table.add_column(col, justify="left" if col in ("worker", "tier") else "right")
    for w in data["workers"]:
        if w["error"]:
            table.add_row(w["worker_id"], "-", *["-"] * (len(columns) - 3), f"[red]{w['error']}[/red]")
            continue
        for t in w["tiers"]:
            table.add_row(
                w["worker_id"], t["tier"] + (" (shared)" if t["shared"] else ""), _size(t["capacity_bytes"]),
                _size(t["used_bytes"]), str(t["blocks"]), _pct(t["hit_rate_blocks"]), _pct(t["hit_rate_tokens"]),
                _size(t["bytes_written"]), _size(t["bytes_read"]), str(t["evictions"]), str(t["promotions"]),
                str(t["errors"] + t["checksum_failures"]), str(t["dropped"]), str(t["quota_refused"]),
                f"{t['get_latency_p50_ms']:.2f}/{t['get_latency_p99_ms']:.2f}",
                f"{t['put_latency_p50_ms']:.2f}/{t['put_latency_p99_ms']:.2f}",
                "yes" if t["healthy"] else "[red]no[/red]")
    return table


@cache_app.command("stats")
def stats(
    router: Optional[str] = typer.Option(None, "--router", help=_ROUTER_HELP),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="STRATA_API_KEY", help=_API_KEY_HELP),
    ca_file: Optional[str] = typer.Option(None, "--ca-file", envvar="STRATA_CA_FILE", help=_CA_FILE_HELP),
    worker: list[str] = typer.Option([], "--worker", help="only this worker (repeatable)"),
    tier: str = typer.Option("", "--tier", help="only this tier: device, host, disk, redis, s3"),
    as_json: bool = typer.Option(False, "--json", help="print JSON (one object; one line per refresh with --watch)"),
    watch: Optional[float] = typer.Option(None, "--watch", help="refresh every SECONDS until Ctrl-C"),
) -> None:
    """Per worker and tier: capacity, used, blocks, hit rates, bytes in/out, evictions, promotions, errors,
    dropped background writes, writes refused by a namespace's quota (shared tiers), latency percentiles; per
    worker: background writes pending."""
    console = _console()
    with _client(router, api_key=api_key, ca_file=ca_file) as client:
        def snapshot() -> dict[str, Any]:
            try:
                return stats_dict(client.cache_stats(worker, tier), client.address)
            except Exception as exc:  # noqa: BLE001 - turned into a clean message
                _fail(exc, router)
                raise
        if watch is None:
            data = snapshot()
            print(json.dumps(data, indent=2)) if as_json else console.print(stats_table(data))
            return
        _watch(snapshot, watch, as_json, console)


def _watch(snapshot, every_s: float, as_json: bool, console) -> None:
    from rich.live import Live

    try:
        if as_json:
            while True:
                print(json.dumps(snapshot()), flush=True)
                time.sleep(every_s)
        with Live(stats_table(snapshot()), console=console, refresh_per_second=4) as live:
            while True:
                time.sleep(every_s)
                live.update(stats_table(snapshot()))
    except KeyboardInterrupt:
        pass


# ------------------------------------------------------------------------------------------------ admin

def _print_results(results, as_json: bool) -> None:
    from rich.table import Table

    if as_json:
        print(json.dumps([{"worker_id": r.worker_id, "tier": r.tier, "shared": r.shared,
                           "blocks_removed": r.blocks_removed, "bytes_freed": r.bytes_freed,
                           "blocks_demoted": r.blocks_demoted, "error": r.error} for r in results], indent=2))
        return
    shared = any(r.shared for r in results)
    table = Table(caption="shared: one backend for every worker; the worker named acted once for all" if shared
                  else None, caption_justify="left")
    for col in ("worker", "tier", "blocks removed", "freed", "demoted", "error"):
        table.add_column(col)
    for r in results:
        table.add_row(r.worker_id or "-", (r.tier or "-") + (" (shared)" if r.shared else ""), str(r.blocks_removed),
                      _size(r.bytes_freed), str(r.blocks_demoted), r.error or "")
    _console().print(table)


def _read_hashes(block_hash: list[str], hashes_from: Optional[str]) -> list[bytes]:
    """`--hash` values, then `--hashes-from` lines (`-` = stdin; blank lines and `#` comments skipped), as 16-byte
    hashes; exit 2 naming the bad one."""
    texts = list(block_hash)
    if hashes_from:
        lines = sys.stdin.read() if hashes_from == "-" else _read_text(hashes_from)
        texts += [line.split("#")[0].strip() for line in lines.splitlines()]
    hashes = []
    for text in filter(None, texts):
        try:
            value = bytes.fromhex(text)
        except ValueError:
            value = b""
        if len(value) != 16:
            typer.echo(f"error: a block hash must be 32 hex digits (16 bytes), got {text!r}", err=True)
            raise typer.Exit(2)
        hashes.append(value)
    return hashes


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as exc:
        typer.echo(f"error: --hashes-from: {exc}", err=True)
        raise typer.Exit(2)


@cache_app.command("evict")
def evict(
    router: Optional[str] = typer.Option(None, "--router", help=_ROUTER_HELP),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="STRATA_API_KEY", help=_API_KEY_HELP),
    ca_file: Optional[str] = typer.Option(None, "--ca-file", envvar="STRATA_CA_FILE", help=_CA_FILE_HELP),
    worker: str = typer.Option("", "--worker", help="only this worker (default: every worker)"),
    tier: str = typer.Option("", "--tier", help="only this tier (default: every local tier; redis/s3 only when "
                                                "named)"),
    num_bytes: int = typer.Option(0, "--bytes", help="free at least this many bytes per tier, by its policy"),
    block_hash: list[str] = typer.Option([], "--hash", help="evict this block (32 hex digits; repeatable)"),
    hashes_from: Optional[str] = typer.Option(None, "--hashes-from",
                                              help="evict the blocks listed in this file, one hash a line (- = stdin)"),
    demote: bool = typer.Option(False, "--demote", help="move to the next slower tier instead of dropping"),
    timeout: Optional[float] = typer.Option(None, "--timeout",
                                            help=_TIMEOUT_HELP.format("60 s + 20 ms a hash")),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Drop (or demote) chosen blocks, or a number of bytes, from the cache tiers. On a shared tier (redis, s3)
    one worker acts for all."""
    hashes = _read_hashes(block_hash, hashes_from)
    if bool(num_bytes) == bool(hashes):
        typer.echo("error: give exactly one of --bytes N and --hash HEX / --hashes-from FILE", err=True)
        raise typer.Exit(2)
    with _client(router, timeout or evict_timeout_s(len(hashes)), api_key, ca_file) as client:
        try:
            results = client.evict_cache(worker, tier, hashes, num_bytes, demote)
        except Exception as exc:  # noqa: BLE001
            _fail(exc, router)
    _print_results(results, as_json)


@cache_app.command("flush")
def flush(
    router: Optional[str] = typer.Option(None, "--router", help=_ROUTER_HELP),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="STRATA_API_KEY", help=_API_KEY_HELP),
    ca_file: Optional[str] = typer.Option(None, "--ca-file", envvar="STRATA_CA_FILE", help=_CA_FILE_HELP),
    worker: str = typer.Option("", "--worker", help="only this worker (default: every worker)"),
    tier: str = typer.Option("", "--tier", help="only this tier (default: every local tier; redis/s3 only when "
                                                "named)"),
    yes: bool = typer.Option(False, "--yes", "-y", help="do not ask for confirmation"),
    timeout: float = typer.Option(FLUSH_TIMEOUT_S, "--timeout", help=_TIMEOUT_HELP.format(f"{FLUSH_TIMEOUT_S:.0f} s")),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Empty cache tiers (pinned blocks stay). A shared tier (redis, s3) is emptied once, by one worker, for all."""
    what = f"tier {tier or 'device/host/disk'} of {worker or 'every worker'}"
    if tier in ("redis", "s3"):
        what = f"the shared {tier} tier (every worker's blocks)"
    if not yes and sys.stdin.isatty() and not typer.confirm(f"Flush {what}?"):
        raise typer.Exit(1)
    with _client(router, timeout, api_key, ca_file) as client:
        try:
            results = client.flush_cache(worker, tier)
        except Exception as exc:  # noqa: BLE001
            _fail(exc, router)
    _print_results(results, as_json)


# ------------------------------------------------------------------------------------------------ workers

def worker_dict(w) -> dict[str, Any]:
    now_ms = int(time.time() * 1000)
    return {"id": w.id, "role": _ROLES.get(w.role, "?"), "state": _STATES.get(w.state, "?"), "address": w.address,
            "model": w.model.id, "running": w.load.running, "waiting": w.load.waiting, "kv_usage": w.load.kv_usage,
            "tiers": list(w.tiers), "kv_events_endpoint": w.kv_events_endpoint,
            "last_heartbeat_age_s": (now_ms - w.last_heartbeat_unix_ms) / 1000 if w.last_heartbeat_unix_ms else None,
            "speculative": speculative_dict(w.speculative) if w.HasField("speculative") else None}


def speculative_dict(s) -> dict[str, Any]:
    """A worker's `SpeculativeStats` (None in the JSON when it does not speculate)."""
    return {"method": s.method, "methods": list(s.methods), "num_speculative_tokens": s.num_speculative_tokens,
            "acceptance_rate": s.acceptance_rate, "mean_accepted_length": s.mean_accepted_length,
            "draft_tokens": s.draft_tokens, "accepted_tokens": s.accepted_tokens, "verifies": s.verifies,
            "emitted_tokens": s.emitted_tokens, "draft_seconds": s.draft_seconds, "verify_seconds": s.verify_seconds}


def _speculative_cell(spec: dict[str, Any] | None) -> str:
    """`ngram 62% x2.4`: the drafter, acceptance rate and mean accepted length; `-` when it does not speculate."""
    if spec is None:
        return "-"
    if not spec["verifies"]:
        return spec["method"]
    return f"{spec['method']} {spec['acceptance_rate']:.0%} x{spec['mean_accepted_length']:.1f}"


def workers(
    router: Optional[str] = typer.Option(None, "--router", help=_ROUTER_HELP),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="STRATA_API_KEY", help=_API_KEY_HELP),
    ca_file: Optional[str] = typer.Option(None, "--ca-file", envvar="STRATA_CA_FILE", help=_CA_FILE_HELP),
    role: Optional[str] = typer.Option(None, "--role", help="only prefill or decode workers"),
    include_dead: bool = typer.Option(False, "--all", help="also list dead workers"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """The workers registered with the router: role, state, address, load, tiers, speculative decoding."""
    from rich.table import Table

    with _client(router, api_key=api_key, ca_file=ca_file) as client:
        try:
            rows = [worker_dict(w) for w in client.workers(role, include_dead)]
        except Exception as exc:  # noqa: BLE001
            _fail(exc, router)
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    table = Table(title=f"Workers (router {router or client.address})", title_justify="left")
    for col in ("id", "role", "state", "address", "running", "waiting", "kv use", "tiers", "speculative",
                "heartbeat"):
        table.add_column(col)
    for r in rows:
        age = "-" if r["last_heartbeat_age_s"] is None else f"{r['last_heartbeat_age_s']:.1f}s ago"
        table.add_row(r["id"], r["role"], r["state"], r["address"], str(r["running"]), str(r["waiting"]),
                      f"{r['kv_usage']:.0%}", ",".join(r["tiers"]), _speculative_cell(r["speculative"]), age)
    _console().print(table)
