"""`strata worker add|remove|list`: workers the router does not start, registered through its admin HTTP API
(`router.vllm_http`, `/admin/workers`).

    strata worker add --kind vllm http://HOST:8000 --events tcp://HOST:5557 [--replay tcp://HOST:5558]
                      [--block-size 16] [--hash-algo sha256] [--hash-seed S] [--lora NAME=PATH ...]
                      [--model ID] [--served-model-name NAME] [--id ID]
    strata worker remove ID
    strata worker list [--json]

Each talks to the router's HTTP API (`--router-http`, or `STRATA_ROUTER_HTTP`, default http://127.0.0.1:8000),
with `--api-key` (or `STRATA_API_KEY`) when the router has API keys, and `--ca-file` (or `STRATA_CA_FILE`) for a
router serving HTTPS. The hashing options must be the vLLM server's own (`--block-size`,
`--prefix-caching-hash-algo`, its PYTHONHASHSEED): the router hashes that worker's requests with them to find the
prefixes it holds.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

import typer

worker_app = typer.Typer(help="Register workers the router does not start (vLLM OpenAI servers).",
                         no_args_is_help=True, add_completion=False)

_ROUTER_HELP = "the router's HTTP API (default: $STRATA_ROUTER_HTTP or http://127.0.0.1:8000)"
_API_KEY_HELP = "the router's API key, when it has any (default: $STRATA_API_KEY)"
_CA_FILE_HELP = "verify an HTTPS router against this PEM CA (default: $STRATA_CA_FILE)"


def _call(method: str, path: str, router: Optional[str], api_key: Optional[str], ca_file: Optional[str],
          body: Any = None) -> dict:
    """The router's JSON answer; exit 1 naming the router and its error message on any failure."""
    import httpx

    base = (router or os.environ.get("STRATA_ROUTER_HTTP") or "http://127.0.0.1:8000").rstrip("/")
    if "://" not in base:
        base = "http://" + base
    key = api_key or os.environ.get("STRATA_API_KEY")
    headers = {"authorization": f"Bearer {key}"} if key else {}
    verify: Any = ca_file or os.environ.get("STRATA_CA_FILE") or True
    try:
        answer = httpx.request(method, base + path, json=body, headers=headers, verify=verify, timeout=10.0,
                               trust_env=False)
    except httpx.HTTPError as exc:
        typer.echo(f"error: cannot reach the router at {base} (is it running with an HTTP port?): {exc}", err=True)
        raise typer.Exit(1)
    try:
        payload = answer.json()
    except ValueError:
        payload = {}
    if answer.status_code != 200:
        message = (payload.get("error") or {}).get("message") if isinstance(payload, dict) else None
        typer.echo(f"error: HTTP {answer.status_code} from the router at {base}: {message or answer.text}", err=True)
        raise typer.Exit(1)
    return payload


def _loras(values: list[str]) -> dict[str, str]:
    out = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            typer.echo(f"error: --lora takes NAME=PATH (the adapter as the vLLM server's --lora-modules names it), "
                       f"got {value!r}", err=True)
            raise typer.Exit(2)
        out[name] = path
    return out


@worker_app.command("add")
def add(
    url: str = typer.Argument(..., help="the worker's OpenAI API, http://HOST:PORT"),
    kind: str = typer.Option(..., "--kind", help="the worker's kind: vllm"),
    events: str = typer.Option(..., "--events", help="its KV-event PUB endpoint, tcp://HOST:PORT"),
    replay: str = typer.Option("", "--replay", help="its KV-event replay endpoint, tcp://HOST:PORT (default: none)"),
    worker_id: str = typer.Option("", "--id", help="its id in the router (default: vllm-HOST:PORT)"),
    model: str = typer.Option("", "--model", help="the router's model id it serves (default: the router's model)"),
    served_model_name: str = typer.Option("", "--served-model-name",
                                          help="the name the vLLM server knows the model by (default: --model)"),
    block_size: int = typer.Option(16, "--block-size", help="its --block-size"),
    hash_algo: str = typer.Option("sha256", "--hash-algo",
                                  help="its --prefix-caching-hash-algo: sha256, sha256_cbor, xxhash, xxhash_cbor"),
    hash_seed: Optional[str] = typer.Option(None, "--hash-seed",
                                            help="its PYTHONHASHSEED, if set (required for the xxhash algorithms)"),
    lora: list[str] = typer.Option([], "--lora", help="a LoRA adapter it serves, NAME=PATH (repeatable)"),
    router: Optional[str] = typer.Option(None, "--router-http", help=_ROUTER_HELP),
    api_key: Optional[str] = typer.Option(None, "--api-key", help=_API_KEY_HELP),
    ca_file: Optional[str] = typer.Option(None, "--ca-file", help=_CA_FILE_HELP),
) -> None:
    """Register a worker with the router: it is routed to by the prefixes it holds and its load."""
    if kind != "vllm":
        typer.echo(f"error: --kind must be vllm (Strata's own workers register themselves with --router), "
                   f"got {kind!r}", err=True)
        raise typer.Exit(2)
    body = {"kind": kind, "url": url, "events": events, "replay": replay, "id": worker_id, "model": model,
            "served_model_name": served_model_name, "block_size": block_size, "hash_algo": hash_algo,
            "hash_seed": hash_seed, "loras": _loras(lora)}
    worker = _call("POST", "/admin/workers", router, api_key, ca_file, body)["worker"]
    typer.echo(f"added {worker['id']} ({worker['url']}, model {worker['model']}, events {worker['events']})")


@worker_app.command("remove")
def remove(
    worker_id: str = typer.Argument(..., help="the worker's id (see `strata worker list`)"),
    router: Optional[str] = typer.Option(None, "--router-http", help=_ROUTER_HELP),
    api_key: Optional[str] = typer.Option(None, "--api-key", help=_API_KEY_HELP),
    ca_file: Optional[str] = typer.Option(None, "--ca-file", help=_CA_FILE_HELP),
) -> None:
    """Unregister a worker: no request goes to it from now on."""
    _call("DELETE", f"/admin/workers/{worker_id}", router, api_key, ca_file)
    typer.echo(f"removed {worker_id}")


@worker_app.command("list")
def list_workers(
    as_json: bool = typer.Option(False, "--json", help="print the router's JSON"),
    router: Optional[str] = typer.Option(None, "--router-http", help=_ROUTER_HELP),
    api_key: Optional[str] = typer.Option(None, "--api-key", help=_API_KEY_HELP),
    ca_file: Optional[str] = typer.Option(None, "--ca-file", help=_CA_FILE_HELP),
) -> None:
    """The registered workers: state, load and KV-event feed."""
    workers = _call("GET", "/admin/workers", router, api_key, ca_file)["workers"]
    if as_json:
        typer.echo(json.dumps(workers, indent=2))
        return
    for w in workers:
        ev = w.get("events") or {}
        load = w.get("load") or {}
        typer.echo(f"{w['id']}  {w['state']}  {w['url']}  model={w['model']}  "
                   f"running={load.get('running', '-')} waiting={load.get('waiting', '-')}  "
                   f"events: {ev.get('batches', 0)} batches, last seq {ev.get('last_seq', -1)}, "
                   f"{ev.get('unknown_media', 0)} unknown media")
