"""moe_bench's expert-parallel summary: one compact table of the EP 2 / EP 1 ratios and the imbalance beside the
targets of issue 14 (`print_summary`), and bar charts of the same (`plot`, matplotlib when installed)."""
from __future__ import annotations

LAYER_TARGET = 1.6          # EP2/EP1 tokens/s of one many-expert layer
IMBALANCE_TARGET = 1.1      # max/mean pairs per rank after a rebalance with replicas


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def print_summary(ep: dict) -> None:
    if not (ep.get("layer") or ep.get("model") or ep.get("balance")):
        return
    print("expert parallel, 2 ranks x 1 thread vs 1 process x 1 thread (median of interleaved rounds):", flush=True)
    print(f"  {'what':<28} {'EP1 tok/s':>10} {'EP2 tok/s':>10} {'EP2/EP1':>8}  target", flush=True)
    for kind, cells, key in (("layer", ep.get("layer", []), "shape"), ("model", ep.get("model", []), "model")):
        for c in cells:
            target = ""
            if kind == "layer" and c["shape"] == "big":
                target = f">= {LAYER_TARGET}x: {_verdict(c['ep2_over_ep1'] >= LAYER_TARGET)}"
            print(f"  {kind + ' ' + c[key]:<28} {c['ep1_tokens_per_s']:>10.0f} {c['ep2_tokens_per_s']:>10.0f} "
                  f"{c['ep2_over_ep1']:>7.2f}x  {target}", flush=True)
    load = ep.get("contention")
    if load:
        print(f"  other work during the EP runs: {load['other_cores']:.2f} of {load['cores']} cores busy with other "
              f"processes, {load['stolen_cores']:.2f} stolen by the hypervisor (EP 2 needs both cores)", flush=True)
    balance = ep.get("balance")
    if balance:
        runs = balance["runs"]
        steps = [f"contiguous {runs[0]['before']['imbalance']:.3f}"]
        steps += [f"R={r['redundant']} {r['after']['imbalance']:.3f}" for r in runs]
        best = runs[-1]
        met = best["redundant"] > 0 and best["after"]["imbalance"] <= IMBALANCE_TARGET
        print(f"  {'imbalance (max/mean)':<28} {' -> '.join(steps)}  target <= {IMBALANCE_TARGET} with R="
              f"{best['redundant']}: {_verdict(met)}", flush=True)


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"no plot: matplotlib is not installed (pip install -e '.[plot]'), {path} not written", flush=True)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ep = result.get("expert_parallel", {})
    cells = [("layer " + c["shape"], c) for c in ep.get("layer", [])] + \
            [("model " + c["model"], c) for c in ep.get("model", [])]
    fig, (speed, balance) = plt.subplots(1, 2, figsize=(12, 4))
    speed.bar([name for name, _ in cells], [c["ep2_over_ep1"] for _, c in cells])
    speed.axhline(1.0, color="black", linewidth=0.8)
    speed.axhline(LAYER_TARGET, linestyle="--", color="gray", label=f"target (layer big) {LAYER_TARGET}x")
    speed.tick_params(axis="x", labelrotation=20)
    speed.set_ylabel("EP 2 / EP 1 tokens/s")
    speed.legend()
    runs = ep.get("balance", {}).get("runs", [])
    if runs:
        names = ["contiguous"] + [f"rebalanced R={r['redundant']}" for r in runs]
        values = [runs[0]["before"]["imbalance"]] + [r["after"]["imbalance"] for r in runs]
        balance.bar(names, values)
        balance.axhline(IMBALANCE_TARGET, linestyle="--", color="gray")
        balance.set_ylabel("max / mean pairs per rank")
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot saved to {path}", flush=True)
