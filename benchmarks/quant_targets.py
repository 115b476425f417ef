"""quant_bench's verdicts and plot: each target of issue 12 beside the figure measured in the run (`targets`,
`report_targets`), and bar charts of the ratios (`plot`, matplotlib when installed)."""
from __future__ import annotations

from typing import NamedTuple

# ---- the targets of the issue ---------------------------------------------------------------------------------

class Target(NamedTuple):
    what: str
    goal: str
    measured: float | None
    met: bool | None
    why: str = ""


def lookup(tree: dict | None, *keys):
    for key in keys:
        if not isinstance(tree, dict) or key not in tree or tree[key] is None:
            return None
        tree = tree[key]
    return tree


def target(what: str, goal: str, value, bound: float, at_most: bool, note: str = "") -> Target:
    if value is None:
        return Target(what, goal, None, None, note or "not run")
    return Target(what, goal, value, value <= bound if at_most else value >= bound, note)


def note_for(section: dict | None, label: str) -> str:
    """Why a scheme has no figure in `section` (its error), or why its figure says nothing (weights unchanged)."""
    error = lookup(section, "rows", label, "error") or lookup(section, "errors", label)
    if error:
        return f"failed: {error[:120]}"
    ratio = lookup(section, "rows", label, "weight_ratio")
    unchanged = ratio is not None and abs(ratio - 1.0) < 1e-9 and label != "bf16" and not label.startswith("kv-")
    return "scheme not applied: weights unchanged" if unchanged else ""


def targets(result: dict, group: int, labels: list[str]) -> list[Target]:
    """The issue's targets: bytes and speed on the dense (0.6B) shape, perplexity on the bundled model; `labels`:
    the weight schemes measured (each one's share of its bandwidth bound)."""
    q, decode = result.get("quality"), result.get("decode") or {}
    dense = decode.get("dense")
    out = []
    # NOTE: the "+vocab" variants (LM head and embedding quantized too): the whole model's bytes, and the quality
    # and speed of that same configuration; the linears-only rows are printed beside them in the tables
    for label, max_bytes, max_ppl, min_speed in (("int8+vocab", 0.55, 1.01, 1.7),
                                                 (f"int4-g{group}+vocab", 0.35, 1.05, 2.5),
                                                 ("mxfp4+vocab", 0.30, 1.10, None)):
        out.append(target(f"{label} weight bytes vs bf16 (dense shape)", f"<= {max_bytes:.2f}x",
                          lookup(dense, "rows", label, "weight_ratio"), max_bytes, True, note_for(dense, label)))
        out.append(target(f"{label} perplexity vs bf16 (bundled model)", f"<= {max_ppl:.2f}x",
                          lookup(q, "rows", label, "ppl_ratio"), max_ppl, True, note_for(q, label)))
        if min_speed:
            out.append(target(f"{label} decode tok/s vs bf16, batch 1 (dense shape)", f">= {min_speed:.1f}x",
                              lookup(dense, "rows", label, "b1", "vs_bf16"), min_speed, False,
                              note_for(dense, label)))
    out.append(target("fp8 KV bytes per token vs bf16 KV", "0.5x (<= 0.51x: scales)",
                      lookup(q, "rows", "kv-fp8", "kv_ratio"), 0.51, True, note_for(q, "kv-fp8")))
    out.append(target("fp8 KV perplexity vs bf16 KV", "<= 1.01x", lookup(q, "rows", "kv-fp8", "ppl_ratio"), 1.01,
                      True, note_for(q, "kv-fp8")))
    for key in ("dense", "moe"):
        for label in labels:
            out.append(target(f"{label} batch 1 share of its bandwidth bound ({key})", ">= 70%",
                              lookup(decode.get(key), "rows", label, "b1", "of_bound"), 0.70, False,
                              note_for(decode.get(key), label)))
    return out


def report_targets(rows: list[Target]) -> None:
    print("\n[targets] issue 12 target vs measured in this run")
    print(f"{'target':<58} {'goal':>24} {'measured':>9}  verdict")
    for t in rows:
        value = "-" if t.measured is None else (f"{t.measured:.1%}" if "share" in t.what else f"{t.measured:.3f}x")
        verdict = "not measured" if t.met is None else ("met" if t.met else "NOT met")
        print(f"{t.what:<58} {t.goal:>24} {value:>9}  {verdict}" + (f" ({t.why})" if t.why else ""))


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"no plot: matplotlib is not installed (pip install -e '.[plot]'), {path} not written")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    q_rows = {k: r for k, r in (lookup(result, "quality", "rows") or {}).items() if "ppl_ratio" in r}
    byte_ratio = {k: r["kv_ratio"] if k.startswith("kv-") else r["weight_ratio"] for k, r in q_rows.items()}
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    bars(axes[0], {"bundled": byte_ratio}, "weight (KV for kv-*) bytes vs bf16")
    bars(axes[1], {"bundled": {k: r["ppl_ratio"] for k, r in q_rows.items()}}, "perplexity vs bf16")
    axes[1].set_ylim(bottom=min([0.99, *(r["ppl_ratio"] for r in q_rows.values())]) - 0.005)
    for ax, key, title in ((axes[2], "vs_bf16", "decode tok/s vs bf16, batch 1"),
                           (axes[3], "of_bound", "batch 1 share of the bandwidth bound")):
        series = {shape: {k: r["b1"][key] for k, r in (lookup(result, "decode", shape, "rows") or {}).items()}
                  for shape in ("dense", "moe")}
        bars(ax, series, title)
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot saved to {path}")


def bars(ax, series: dict[str, dict[str, float]], title: str) -> None:
    """Grouped bars: one group per scheme, one bar per series."""
    labels = list(dict.fromkeys(k for values in series.values() for k in values))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        ax.bar([j + i * width for j in range(len(labels))], [values.get(k, 0.0) for k in labels], width, label=name)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(labels))], labels, rotation=45)
    ax.set_title(title)
    if len(series) > 1:
        ax.legend()
