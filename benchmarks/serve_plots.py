"""PNG plots of `serve_bench.py` (matplotlib, Agg): latency CDFs, goodput against request rate, hit ratio per tier.

Each function writes one file and says where; without matplotlib it says so and writes nothing (the figures are
in the printed tables and the JSON record either way).
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

from serve_client import Record

TIER_ORDER = ("device", "host", "disk", "redis", "s3", "peer")


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        print("no plots: matplotlib is not installed (pip install -e '.[plot]')")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot saved to {path}")


def latency_cdfs(records: Mapping[str, Sequence[Record]], path: Path, title: str) -> None:
    """TTFT, ITL and end-to-end latency CDFs, one line per arm (ms, log x)."""
    plt = _pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    metrics = (("TTFT", lambda rs: [r.ttft for r in rs]), ("ITL", lambda rs: [g for r in rs for g in r.itl]),
               ("end-to-end", lambda rs: [r.e2e for r in rs]))
    for ax, (name, values_of) in zip(axes, metrics):
        for arm, recs in records.items():
            values = sorted(v * 1e3 for v in values_of([r for r in recs if r.ok]))
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=arm)
        ax.set_xscale("log")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction ≤ x")
        ax.axhline(0.99, color="grey", lw=0.5, ls=":")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title, fontsize=9)
    _save(fig, path)


def goodput_vs_rate(disagg: Mapping, path: Path) -> None:
    """Goodput (medians over rounds) and p99 ITL against the offered request rate, per arm."""
    plt = _pyplot()
    if plt is None:
        return
    rates = disagg["rates"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax.plot(rates, rates, color="grey", ls=":", label="offered")
    # dashed: the tightest SLO of the sensitivity table (--slo's TTFT bound, the smallest TPOT bound)
    tight = min(disagg.get("goodput_by_slo", {}).values(), key=lambda row: (row["ttft_s"], row["tpot_s"]),
                default=None)
    for i, (arm, table) in enumerate(disagg["medians"].items()):
        color = f"C{i}"
        ax.plot(rates, [table[str(r)]["goodput"] for r in rates], marker="o", color=color, label=arm)
        if tight:
            ax.plot(rates, [tight["by_rate"][str(r)][arm] for r in rates], marker="x", ls="--", color=color,
                    label=f"{arm}, {tight['slo']}")
        ax2.plot(rates, [table[str(r)]["itl.p99"] * 1e3 for r in rates], marker="o", color=color, label=arm)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("goodput (req/s)")
    ax.set_title(f"goodput (medians), solid: SLO {disagg['slo']}", fontsize=9)
    ax.legend(fontsize=8)
    ax2.set_xlabel("request rate (req/s)")
    ax2.set_ylabel("p99 ITL (ms)")
    ax2.set_title("p99 inter-token latency", fontsize=9)
    ax2.legend(fontsize=8)
    for a in (ax, ax2):
        a.grid(alpha=0.3)
    _save(fig, path)


def hit_ratios(policies: Mapping | None, store: Mapping | None, path: Path) -> None:
    """Stacked bars: the share of prompt tokens each tier served, per routing policy and per store configuration."""
    plt = _pyplot()
    if plt is None:
        return
    panels = [(title, data["hit_ratio"]) for title, data in
              (("per routing policy (Mooncake trace)", policies), ("tiered store vs device-only (sessions)", store))
              if data]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.6), squeeze=False)
    for ax, (title, by_arm) in zip(axes[0], panels):
        arms = list(by_arm)
        bottom = [0.0] * len(arms)
        tiers = [t for t in TIER_ORDER if any(t in by_arm[a] for a in arms)]
        for tier in tiers:
            values = [by_arm[a].get(tier, 0.0) * 100 for a in arms]
            ax.bar(arms, values, bottom=bottom, label=tier)
            bottom = [b + v for b, v in zip(bottom, values)]
        for i, arm in enumerate(arms):
            ax.text(i, bottom[i], f"{by_arm[arm]['total']:.1%}", ha="center", va="bottom", fontsize=8)
        ax.set_ylabel("prompt tokens served from cache (%)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
    _save(fig, path)
