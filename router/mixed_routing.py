"""Mixed fleets (issue 18 item 3): does a request go to a vLLM worker, or to Strata's own workers?

Each kind of worker is matched in its own hash space, then priced by the same policy and cost model:

    prompt ─┬─ Strata's hash (namespace + salt) ──> index.match ──> policy(Strata workers)    ──> S
            └─ per vLLM hash space (block size, algorithm, seed, LoRA): vLLM's hash (+ salt, LoRA)
                 ──> index.match ──> each vLLM worker's cached run, on the model's block grid
                 ──> policy(vLLM workers, each prefilling and decoding itself)                 ──> V

V wins when no Strata worker can take the request, when the request names a LoRA adapter (only vLLM workers serve
those), or when its predicted TTFT is lower than S's; a tie stays with Strata's workers. Between vLLM workers the
policy's load guard applies as between Strata's; a vLLM worker's queue is priced as its waiting requests (from its
/metrics) times this prompt's prefill.

A vLLM worker's cached run is put on the model's block grid by tokens: n of its blocks of B_v tokens cover
n * B_v tokens, i.e. floor(n * B_v / B) blocks of the model's B:

    vLLM  (B_v = 32)  |      0      |      1      |      2      |
    grid  (B = 16)    |  0   |  1   |  2   |  3   |  4   |  5   |     block j takes the tier of vLLM block
                                                                      ((j + 1) * B - 1) // B_v
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from kvstore.hashing import hash_blocks
from router.index import MatchResult, WorkerId
from router.load import LoadView, WorkerLoad
from router.policy import RouteDecision, RouteRequest
from router.served_model import ServedModel
from router.vllm_hashing import VllmRequestKeys, vllm_block_keys
from router.vllm_workers import VllmFleet, VllmWorkerSpec

if TYPE_CHECKING:
    from router.dispatch import Dispatcher

_ALWAYS_LOCAL = 1 << 62  # a vLLM worker prefills its own requests: the policy's local branch, always


@dataclass(frozen=True)
class MixedRoute:
    """A vLLM worker chosen for a request: the policy's decision among the vLLM workers, and the best Strata
    plan's predicted TTFT it beat (None: no Strata worker could take the request)."""

    worker: VllmWorkerSpec
    decision: RouteDecision
    strata_ttft_s: float | None


def _keys(spec: VllmWorkerSpec, salt: str, lora: str | None) -> VllmRequestKeys:
    path = spec.lora_path(lora) if lora is not None else None
    return VllmRequestKeys(salt, None if path is None else (lora, path))


def _on_grid(run: dict[int, int], vllm_block: int, block: int) -> dict[int, int]:
    """A worker's leading run {vLLM block: tier mask} as {grid block: tier mask} (module docstring)."""
    n = 0
    while n in run:
        n += 1
    covered = n * vllm_block // block
    return {j: run[((j + 1) * block - 1) // vllm_block] for j in range(covered)}


def vllm_match(fleet_index, specs: Sequence[VllmWorkerSpec], prompt: Sequence[int], salt: str, lora: str | None,
               block: int) -> MatchResult:
    """Each vLLM worker's cached prefix of `prompt`, on the model's block grid; one hash chain per hash space."""
    local: dict[WorkerId, dict[int, int]] = {}
    chains: dict[tuple, MatchResult] = {}
    for spec in specs:
        keys = _keys(spec, salt, lora)
        space = (spec.hashing, keys)
        if space not in chains:
            chains[space] = fleet_index.match(vllm_block_keys(spec.hashing, prompt, keys))
        run = chains[space].local.get(spec.id, {})
        if 0 in run:
            local[spec.id] = _on_grid(run, spec.hashing.block_size, block)
    pooled = max((len(r) for r in local.values()), default=0)
    return MatchResult(len(prompt) // block, pooled, (0,) * pooled, local)


def _view(fleet: VllmFleet, specs: Sequence[VllmWorkerSpec], prefill_s: float) -> LoadView:
    """The vLLM workers' loads, each one's waiting requests priced as `prefill_s` apiece."""
    ids = {s.id for s in specs}
    loads: list[WorkerLoad] = []
    for w in fleet.registry.load_view(exclude=()).workers:
        if w.worker_id in ids:
            waiting = fleet.registry.get(w.worker_id).load.waiting
            loads.append(dataclasses.replace(w, backlog_s=waiting * prefill_s))
    return LoadView.of(loads)


def choose(fleet: VllmFleet, dispatcher: "Dispatcher", model: ServedModel, prompt: Sequence[int], salt: str,
           lora: str | None = None) -> MixedRoute | None:
    """The vLLM worker to proxy the request to, or None: Strata's own workers serve it (module docstring)."""
    specs = fleet.serving(model.id, lora)
    if not specs:
        return None
    hashes = hash_blocks(model.namespace.with_salt(salt).fingerprint(), prompt, model.block_size)
    strata = None if lora is not None else dispatcher.preview(model, hashes, len(prompt))
    cost = dispatcher.cost[model.id]
    vllm_cost = cost.replace(local_prefill_max_uncached_tokens=_ALWAYS_LOCAL, peer_fetch=False)
    match = vllm_match(dispatcher.index, specs, prompt, salt, lora, model.block_size)
    view = _view(fleet, specs, len(prompt) / cost.prefill_tokens_per_s)
    if not view.workers:
        return None
    decision = dispatcher.policy(RouteRequest(tuple(hashes), len(prompt), fleet.next_seq()), match, view,
                                 vllm_cost)
    if strata is not None and decision.predicted_ttft_s >= strata.predicted_ttft_s:
        return None
    spec = next(s for s in specs if s.id == decision.decode_worker)
    return MixedRoute(spec, decision, None if strata is None else strata.predicted_ttft_s)
