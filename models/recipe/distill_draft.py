"""Distil the bundled draft model (a tiny dense Qwen3) from the trained target, on one CPU thread, to a time limit.

    python models/recipe/distill_draft.py --minutes 19 --target models/strata-moe-tiny --out models/strata-draft-tiny

The student sees random windows of the train split and minimises KL(target || draft) at every position (as the
soft-label cross-entropy, which has the same gradient); the target runs under ``torch.inference_mode`` with bf16
autocast. At the end the script measures, on the whole held-out split:
the draft's perplexity (on the true next tokens), its top-1 agreement with the target (argmax equal: what greedy
speculative decoding accepts) and the mean of ``sum(min(p_target, p_draft))`` over the vocabulary (the expected
acceptance probability per token of exact rejection sampling at temperature 1). Results go to ``distill.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

from prepare_data import REPO_ROOT, load_tokens
from train import EOT_ID, eval_windows, lr_at, sample_batch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, default=REPO_ROOT / "models" / "strata-moe-tiny")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "models" / "strata-draft-tiny")
    p.add_argument("--minutes", type=float, default=19.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--bench", type=int, default=0)
    return p.parse_args()


def make_config(args: argparse.Namespace) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=4096,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=EOT_ID,
        eos_token_id=EOT_ID,
        pad_token_id=EOT_ID,
    )


def load_target(path: Path) -> torch.nn.Module:
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    return target


def logits_of(model: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(input_ids=inputs).logits.float()  # [batch, seq, vocab]


def kl_loss(student_logits: torch.Tensor, teacher_probs: torch.Tensor) -> torch.Tensor:
    """Soft-label cross-entropy H(teacher, student), mean over positions.

    NOTE: it equals KL(teacher || student) + H(teacher); the entropy term has no gradient, so the update is the
    KL's, at the cost of one fused op instead of the several passes over [positions, vocab] that kl_div makes.
    """
    vocab = student_logits.size(-1)
    return F.cross_entropy(student_logits.reshape(-1, vocab), teacher_probs.reshape(-1, vocab))


def entropy(probs: torch.Tensor) -> torch.Tensor:
    return -(probs * probs.clamp_min(1e-30).log()).sum(-1).mean()


@torch.inference_mode()
def measure(draft, target, windows: torch.Tensor, chunk: int = 8) -> dict:
    """Held-out CE of draft and target, top-1 agreement and expected acceptance, over ``windows``."""
    draft.eval()
    sums = {"draft_ce": 0.0, "target_ce": 0.0, "agree": 0.0, "accept": 0.0}
    positions = 0
    for i in range(0, len(windows), chunk):
        rows = windows[i : i + chunk]
        labels = rows[:, 1:].reshape(-1)
        d, t = logits_of(draft, rows[:, :-1]), logits_of(target, rows[:, :-1])
        d, t = d.reshape(-1, d.size(-1)), t.reshape(-1, t.size(-1))  # [positions, vocab]
        sums["draft_ce"] += F.cross_entropy(d, labels, reduction="sum").item()
        sums["target_ce"] += F.cross_entropy(t, labels, reduction="sum").item()
        sums["agree"] += (d.argmax(-1) == t.argmax(-1)).sum().item()
        sums["accept"] += torch.minimum(d.softmax(-1), t.softmax(-1)).sum(-1).sum().item()
        positions += labels.numel()
    draft.train()
    m = {k: v / positions for k, v in sums.items()}
    return {"heldout_tokens": positions, "draft_heldout_loss": m["draft_ce"],
            "draft_heldout_perplexity": math.exp(m["draft_ce"]), "target_heldout_perplexity": math.exp(m["target_ce"]),
            "top1_agreement": m["agree"], "expected_acceptance_t1": m["accept"]}


def save(draft: torch.nn.Module, args: argparse.Namespace) -> None:
    copy.deepcopy(draft).to(torch.bfloat16).save_pretrained(args.out)
    GenerationConfig(eos_token_id=EOT_ID, pad_token_id=EOT_ID, bos_token_id=EOT_ID,
                     do_sample=False, max_new_tokens=128).save_pretrained(args.out)
    for name in TOKENIZER_FILES:
        shutil.copyfile(args.target / name, args.out / name)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    target = load_target(args.target)
    draft = Qwen3ForCausalLM(make_config(args))
    draft.train()
    n_params = sum(p.numel() for p in draft.parameters())
    print(f"draft params: {n_params:,}", flush=True)
    train_tokens = load_tokens("train")
    decay = [p for p in draft.parameters() if p.dim() >= 2]
    no_decay = [p for p in draft.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    budget, start, step, log = args.minutes * 60, time.time(), 0, []
    while (step < args.bench) if args.bench else (time.time() - start < budget):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(args, step, time.time() - start, budget)
        rows = sample_batch(train_tokens, rng, args.batch, args.seq_len)
        with torch.inference_mode():
            teacher = logits_of(target, rows[:, :-1]).softmax(-1)  # [batch, seq, vocab]
        loss = kl_loss(logits_of(draft, rows[:, :-1]), teacher.clone())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        step += 1
        if step % 10 == 0 or args.bench:
            seen, secs = step * args.batch * args.seq_len, time.time() - start
            kl = loss.item() - entropy(teacher).item()
            log.append({"step": step, "tokens": seen, "seconds": round(secs, 1), "kl": kl})
            print(f"step {step} tok {seen} {secs:.0f}s kl {kl:.4f} {seen / secs:.0f} tok/s", flush=True)
    if args.bench:
        return
    seconds = time.time() - start
    args.out.mkdir(parents=True, exist_ok=True)
    save(draft, args)
    result = {"params": n_params, "steps": step, "tokens": step * args.batch * args.seq_len,
              "train_seconds": round(seconds, 1), "final_kl": log[-1]["kl"] if log else None, "threads": 1,
              "minutes": args.minutes, "seq_len": args.seq_len, "batch": args.batch, "lr": args.lr,
              **measure(draft, target, eval_windows(load_tokens("heldout"), args.seq_len, None)), "log": log}
    print("FINAL " + json.dumps({k: v for k, v in result.items() if k != "log"}), flush=True)
    (args.out / "distill.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
