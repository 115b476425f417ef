"""Train Strata's bundled target model, a tiny Qwen3-MoE, from scratch on one CPU thread, to a wall-clock limit.

    python models/recipe/train.py --minutes 80 --out models/strata-moe-tiny

Needs ``runs/data/{train,heldout}.bin`` (see ``prepare_data.py``) and the tokenizer in ``--out``. Batches are random
windows of the train tokens drawn from a seeded generator; the learning rate warms up linearly, then follows a
cosine over the *time* budget (so the run ends at the minimum LR when the clock runs out, whatever the step rate).
Every ``--eval-minutes`` it measures the loss on a fixed held-out subset and rewrites ``loss_curve.json``; every
``--ckpt-minutes`` it saves a usable checkpoint (bfloat16 safetensors) into ``--out``; at the end it saves the final
weights, measures the loss on the whole held-out split and draws ``loss_curve.png``.
``--bench N`` only times N steps and exits (used to pick the model size).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

from prepare_data import REPO_ROOT, load_tokens

EOT_ID = 0  # <|endoftext|>, see train_tokenizer.SPECIAL_TOKENS


SAMPLING_DEFAULTS = dict(do_sample=True, temperature=0.3, top_p=0.9, top_k=0, repetition_penalty=1.3)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "models" / "strata-moe-tiny")
    p.add_argument("--minutes", type=float, default=80.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--moe-inter", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-minutes", type=float, default=5.0)
    p.add_argument("--ckpt-minutes", type=float, default=10.0)
    p.add_argument("--eval-windows", type=int, default=64)
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True, help="bf16 autocast (AMX CPUs)")
    p.add_argument("--bench", type=int, default=0)
    p.add_argument("--resume", action="store_true",
                   help="a further stage: start from the weights and loss curve in --out (fresh AdamW, warmup, cosine "
                        "over --minutes); use another --seed so the batches differ from the first stage's")
    return p.parse_args()


def make_config(args: argparse.Namespace) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=4096,
        hidden_size=args.hidden,
        intermediate_size=args.moe_inter,  # unused: every layer is sparse (decoder_sparse_step=1)
        moe_intermediate_size=args.moe_inter,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 128),
        head_dim=64,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        router_aux_loss_coef=0.01,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=EOT_ID,
        eos_token_id=EOT_ID,
        pad_token_id=EOT_ID,
    )


def count_params(config: Qwen3MoeConfig, model: torch.nn.Module) -> tuple[int, int]:
    """(total, active per token): active counts top_k of num_experts expert weights."""
    total = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return total, total - expert + expert * config.num_experts_per_tok // config.num_experts


def sample_batch(tokens: np.ndarray, rng: np.random.Generator, batch: int, seq_len: int) -> torch.Tensor:
    starts = rng.integers(0, tokens.size - seq_len - 1, size=batch)
    rows = np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int64)
    return torch.from_numpy(rows)  # [batch, seq_len + 1]


def eval_windows(tokens: np.ndarray, seq_len: int, n: int | None) -> torch.Tensor:
    """Non-overlapping windows of the held-out split; ``n`` evenly spaced ones, or all when ``n`` is None."""
    total = (tokens.size - 1) // seq_len
    picks = range(total) if n is None else np.linspace(0, total - 1, num=min(n, total)).astype(int)
    rows = [tokens[i * seq_len : i * seq_len + seq_len + 1].astype(np.int64) for i in picks]
    return torch.from_numpy(np.stack(rows))  # [windows, seq_len + 1]


def lm_loss(model: torch.nn.Module, rows: torch.Tensor, autocast) -> tuple[torch.Tensor, torch.Tensor]:
    """(next-token cross-entropy, router load-balancing loss) for ``rows`` [batch, seq_len + 1]."""
    with autocast():
        out = model(input_ids=rows[:, :-1], output_router_logits=True)
    logits = out.logits.float()  # [batch, seq_len, vocab]
    ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), rows[:, 1:].reshape(-1))
    aux = out.aux_loss if out.aux_loss is not None else torch.zeros(())
    return ce, aux


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows: torch.Tensor, autocast, chunk: int = 16) -> float:
    model.eval()
    losses = [lm_loss(model, windows[i : i + chunk], autocast)[0] * len(windows[i : i + chunk])
              for i in range(0, len(windows), chunk)]
    model.train()
    return float(torch.stack(losses).sum() / len(windows))


def lr_at(args: argparse.Namespace, step: int, elapsed: float, budget: float) -> float:
    warm = min(1.0, (step + 1) / args.warmup_steps)
    frac = min(1.0, elapsed / budget)
    cosine = args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
    return args.lr * warm * cosine


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def save_checkpoint(model: torch.nn.Module, out: Path) -> None:
    """bfloat16 safetensors: half the bytes of fp32, and what the engine serves anyway."""
    # NOTE: a bf16 copy (not a hand-made state dict) so save_pretrained drops the tied lm_head and records the dtype.
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(out)
    # Sampling defaults (applied by Strata and vLLM to options a request leaves out): greedy decoding of a model
    # this small loops, a mild temperature with a repetition penalty reads like Python (model card, "Samples").
    GenerationConfig(eos_token_id=EOT_ID, pad_token_id=EOT_ID, bos_token_id=EOT_ID, max_new_tokens=128,
                     **SAMPLING_DEFAULTS).save_pretrained(out)


def plot_curve(curve: dict, out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no loss_curve.png")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    train = curve["train"]
    ax.plot([r["tokens"] / 1e6 for r in train], [r["loss_smoothed"] for r in train], label="train (smoothed)")
    ax.plot([r["tokens"] / 1e6 for r in curve["heldout"]], [r["loss"] for r in curve["heldout"]], "o-",
            label="held-out")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(curve.get("title", "loss"))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss_curve.png", dpi=100)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if args.bf16 else nullcontext

    if args.resume:  # NOTE: the checkpoint is bf16; training goes on in fp32 master weights from it
        model = Qwen3MoeForCausalLM.from_pretrained(args.out, dtype=torch.float32)
        config = model.config
    else:
        config = make_config(args)
        model = Qwen3MoeForCausalLM(config)
    model.train()
    total, active = count_params(config, model)
    print(f"params: total {total:,}, active {active:,}", flush=True)
    train_tokens, heldout_tokens = load_tokens("train"), load_tokens("heldout")
    eval_rows = eval_windows(heldout_tokens, args.seq_len, args.eval_windows)
    optimizer = make_optimizer(model, args)

    budget = args.minutes * 60
    stage = {"minutes": args.minutes, "lr": args.lr, "seed": args.seed, "warmup_steps": args.warmup_steps}
    if args.resume:
        curve = json.loads((args.out / "loss_curve.json").read_text())
        done = curve.pop("final")
        curve.setdefault("stages", [{"minutes": float(curve["args"]["minutes"]), "lr": float(curve["args"]["lr"]),
                                     "seed": int(curve["args"]["seed"]),
                                     "warmup_steps": int(curve["args"]["warmup_steps"]), "steps": done["steps"],
                                     "tokens": done["tokens"]}])
        base = (done["steps"], done["tokens"], done["train_seconds"])
    else:
        curve = {"title": f"strata-moe-tiny ({total / 1e6:.1f}M total, {active / 1e6:.1f}M active)",
                 "params_total": total, "params_active": active,
                 "args": {k: str(v) for k, v in vars(args).items()}, "train": [], "heldout": []}
        base = (0, 0, 0.0)
    tokens_per_step = args.batch * args.seq_len
    start = time.time()
    last_eval = last_ckpt = start
    smoothed = None
    step = 0
    while True:
        elapsed = time.time() - start
        if (args.bench and step >= args.bench) or (not args.bench and elapsed >= budget):
            break
        lr = lr_at(args, step, elapsed, budget)
        for group in optimizer.param_groups:
            group["lr"] = lr
        ce, aux = lm_loss(model, sample_batch(train_tokens, rng, args.batch, args.seq_len), autocast)
        loss = ce + config.router_aux_loss_coef * aux
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        smoothed = ce.item() if smoothed is None else 0.98 * smoothed + 0.02 * ce.item()
        seen = base[1] + step * tokens_per_step
        if step % 10 == 0 or args.bench:
            rate = step * tokens_per_step / (time.time() - start)
            curve["train"].append({"step": base[0] + step, "tokens": seen,
                                   "seconds": round(base[2] + time.time() - start, 1), "lr": lr, "loss": ce.item(),
                                   "loss_smoothed": smoothed, "aux": aux.item()})
            print(f"step {step} tok {seen} {time.time() - start:.0f}s loss {ce.item():.3f} "
                  f"smooth {smoothed:.3f} aux {aux.item():.3f} lr {lr:.2e} {rate:.0f} tok/s", flush=True)
        if args.bench:
            continue
        now = time.time()
        if now - last_eval >= args.eval_minutes * 60:
            record_eval(model, eval_rows, autocast, curve, base[0] + step, seen, base[2] + now - start, args.out)
            last_eval = time.time()
        if now - last_ckpt >= args.ckpt_minutes * 60:
            save_checkpoint(model, args.out)
            plot_curve(curve, args.out)
            print(f"checkpoint at step {step}", flush=True)
            last_ckpt = time.time()
    if args.bench:
        return
    stage.update(steps=step, tokens=step * tokens_per_step)
    if args.resume:
        curve["stages"].append(stage)
    finish(model, args, curve, eval_rows, heldout_tokens, autocast, base[0] + step,
           base[1] + step * tokens_per_step, base[2] + time.time() - start)


def record_eval(model, eval_rows, autocast, curve, step, seen, seconds, out: Path) -> None:
    loss = evaluate(model, eval_rows, autocast)
    curve["heldout"].append({"step": step, "tokens": seen, "seconds": round(seconds, 1), "loss": loss,
                             "perplexity": math.exp(loss)})
    print(f"EVAL step {step} tok {seen} heldout loss {loss:.4f} ppl {math.exp(loss):.2f}", flush=True)
    (out / "loss_curve.json").write_text(json.dumps(curve, indent=1) + "\n")


def finish(model, args, curve, eval_rows, heldout_tokens, autocast, step, seen, seconds) -> None:
    record_eval(model, eval_rows, autocast, curve, step, seen, seconds, args.out)
    save_checkpoint(model, args.out)
    full_loss = evaluate(model, eval_windows(heldout_tokens, args.seq_len, None), autocast)
    curve["final"] = {"steps": step, "tokens": seen, "train_seconds": round(seconds, 1),
                      "train_loss_smoothed": curve["train"][-1]["loss_smoothed"],
                      "heldout_full_loss": full_loss, "heldout_full_perplexity": math.exp(full_loss),
                      "heldout_full_tokens": int(((heldout_tokens.size - 1) // args.seq_len) * args.seq_len),
                      "threads": torch.get_num_threads(), "bf16_autocast": args.bf16}
    print(f"FINAL {json.dumps(curve['final'])}", flush=True)
    (args.out / "loss_curve.json").write_text(json.dumps(curve, indent=1) + "\n")
    plot_curve(curve, args.out)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
