"""Train the EAGLE draft head ``strata-eagle-tiny`` for the frozen target, on one CPU thread, to a time limit.

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python models/recipe/train_eagle.py --minutes 25 \\
        --target models/strata-moe-tiny --out models/strata-eagle-tiny

The head (``eagle_head.py``: fc over [token embedding, target feature] + one Qwen3 decoder layer, the target's own
embedding / final norm / LM head around it) sees random windows of the train split. The target runs under
``torch.inference_mode`` with bf16 autocast and gives its features f (last decoder layer output, before the final
norm) and its next-token distributions. The loss, per draft step, is KL(target || draft) on the draft's logits for
t_{n+2} (as the soft-label cross-entropy, as in ``distill_draft.py``) plus ``--feat-weight`` x smooth-L1 between
the head's output g_n and f_{n+1}. With ``--unroll 2`` a second step feeds the head its own g instead of the
target's feature (training-time test, as in HASS / EAGLE-3), which is what drafting does after the first token.
The learning rate warms up, then follows a cosine over the time budget; every ``--ckpt-minutes`` the head is saved.

At the end it reloads the saved bfloat16 head and measures on held-out text (``eagle_metrics.py``): step-1 top-1
agreement and expected acceptance at temperature 1 on the whole held-out split, and the multi-step greedy
acceptance (verified by the target) of the head and of the standalone draft ``--draft`` on ``--chain-windows``
evenly spaced held-out windows. Results go to ``eagle.json``; ``--eval-only`` re-measures a saved head.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from eagle_head import EagleHead, Target, autocast, head_config, load_head, save_head, soft_ce, unroll
from eagle_metrics import eagle_drafts, load_draft_model, model_drafts, multistep_metrics, step1_metrics
from prepare_data import REPO_ROOT, load_tokens
from train import eval_windows, lr_at, sample_batch

MODELS = REPO_ROOT / "models"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
DRAFT_STEPS = 5  # multi-step measurement: P(first j match) for j = 1..5, accepted tokens for 4 and 5 drafts


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, default=MODELS / "strata-moe-tiny")
    p.add_argument("--out", type=Path, default=MODELS / "strata-eagle-tiny")
    p.add_argument("--draft", type=Path, default=MODELS / "strata-draft-tiny",
                   help="standalone draft model measured alongside, for comparison")
    p.add_argument("--minutes", type=float, default=25.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--unroll", type=int, default=2, help="draft steps trained per window (1: teacher features only)")
    p.add_argument("--feat-weight", type=float, default=0.1, help="weight of the smooth-L1 feature regression")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--ckpt-minutes", type=float, default=5.0)
    p.add_argument("--heldout-windows", type=int, default=None,
                   help="step-1 metrics on this many evenly spaced held-out windows (default: the whole split)")
    p.add_argument("--chain-windows", type=int, default=64,
                   help="multi-step metrics on this many held-out windows (0: skip them)")
    p.add_argument("--eval-only", action="store_true", help="measure the head saved in --out, do not train")
    p.add_argument("--bench", type=int, default=0, help="only time this many training steps")
    args = p.parse_args()
    if args.unroll < 1:
        raise SystemExit(f"--unroll must be >= 1, got {args.unroll}")
    return args


def make_optimizer(head: EagleHead, args: argparse.Namespace) -> torch.optim.Optimizer:
    # NOTE: fc is not decayed: its feature half starts at the identity and its token half is deliberately large.
    decay = [p for n, p in head.named_parameters() if p.dim() >= 2 and not n.startswith("fc.")]
    rest = [p for n, p in head.named_parameters() if p.dim() < 2 or n.startswith("fc.")]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))


def step_losses(head: EagleHead, target: Target, rows: torch.Tensor, args: argparse.Namespace,
                with_entropy: bool) -> list[tuple]:
    """(KL-gradient loss, feature loss, target entropy or 0) per unrolled draft step on ``rows`` [b, T + 1]."""
    out = target.run(rows)
    # NOTE: clone / softmax outside inference mode give ordinary tensors, which autograd may save
    feats, probs = out.feats.clone(), out.logits.softmax(-1)  # [b, T + 1, hidden], [b, T + 1, vocab]
    t = rows.size(1) - 1
    losses = []
    with autocast():
        outs = unroll(head, target, rows[:, 1:], feats[:, :-1], steps=args.unroll)
    for s, g in enumerate(outs):
        # step s + 1, row n: head position n + s predicts f_{n+s+1} and t_{n+s+2}; rows n < T - s have both
        g = g[:, : t - s]
        with autocast():
            logits = target.draft_logits(g)  # [b, T - s, vocab]
        teacher = probs[:, 1 + s :]
        feat = F.smooth_l1_loss(g.float(), feats[:, 1 + s :])
        entropy = -(teacher * teacher.clamp_min(1e-30).log()).sum(-1).mean().item() if with_entropy else 0.0
        losses.append((soft_ce(logits, teacher), feat, entropy))
    return losses


def train(head: EagleHead, target: Target, args: argparse.Namespace, sha256: str) -> dict:
    rng = np.random.default_rng(args.seed)
    train_tokens = load_tokens("train")
    optimizer = make_optimizer(head, args)
    budget, start, step, log = args.minutes * 60, time.time(), 0, []
    last_ckpt = start
    head.train()
    while (step < args.bench) if args.bench else (time.time() - start < budget):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(args, step, time.time() - start, budget)
        logging = (step + 1) % 10 == 0 or args.bench
        losses = step_losses(head, target, sample_batch(train_tokens, rng, args.batch, args.seq_len), args, logging)
        loss = sum(kl + args.feat_weight * feat for kl, feat, _ in losses) / len(losses)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        step += 1
        if logging:
            seen, secs = step * args.batch * args.seq_len, time.time() - start
            kls = [kl.item() - ent for kl, _, ent in losses]
            feats = [feat.item() for _, feat, _ in losses]
            log.append({"step": step, "tokens": seen, "seconds": round(secs, 1), "kl": kls, "feat_l1": feats})
            print(f"step {step} tok {seen} {secs:.0f}s kl {' '.join(f'{k:.3f}' for k in kls)} "
                  f"feat {' '.join(f'{f:.3f}' for f in feats)} {seen / secs:.0f} tok/s", flush=True)
        if not args.bench and time.time() - last_ckpt >= args.ckpt_minutes * 60:
            save_head(head, target, args.out, sha256)
            print(f"checkpoint at step {step}", flush=True)
            last_ckpt = time.time()
    return {"steps": step, "tokens": step * args.batch * args.seq_len, "train_seconds": round(time.time() - start, 1),
            "final_kl": log[-1]["kl"] if log else None, "log": log}


def first_batch_feature_rms(target: Target, args: argparse.Namespace) -> float:
    rows = sample_batch(load_tokens("train"), np.random.default_rng(args.seed + 1), 2, args.seq_len)
    return target.run(rows).feats.pow(2).mean().sqrt().item()


def measure(args: argparse.Namespace, target: Target) -> dict:
    """Reload the saved bfloat16 head (what ships) and measure it and the standalone draft on held-out text."""
    torch.manual_seed(args.seed)
    head = load_head(args.out, target)
    heldout = load_tokens("heldout")
    result = {"heldout_windows": args.heldout_windows or "all", **step1_metrics(
        head, target, eval_windows(heldout, args.seq_len, args.heldout_windows))}
    print("STEP1 " + json.dumps(result), flush=True)
    if args.chain_windows:
        windows = eval_windows(heldout, args.seq_len, args.chain_windows)
        eagle = multistep_metrics(lambda rows: eagle_drafts(head, target, rows, DRAFT_STEPS), target, windows,
                                  k=DRAFT_STEPS)
        print("EAGLE multistep " + json.dumps(eagle), flush=True)
        draft_model = load_draft_model(args.draft)
        draft = multistep_metrics(lambda rows: model_drafts(draft_model, rows, DRAFT_STEPS), target, windows,
                                  k=DRAFT_STEPS)
        print("DRAFT multistep " + json.dumps(draft), flush=True)
        result["multistep"] = {"windows": len(windows), "seq_len": args.seq_len, "draft_steps": DRAFT_STEPS,
                               "eagle": eagle, "draft_model": {"path": args.draft.name, **draft}}
    return result


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    target = Target(args.target)
    sha256 = target.weights_sha256()
    record_path = args.out / "eagle.json"
    if args.eval_only:
        record = json.loads(record_path.read_text()) if record_path.exists() else {}
    else:
        head = EagleHead(head_config(target.config, args.intermediate))
        head.init_from(target, first_batch_feature_rms(target, args))
        n_params = sum(p.numel() for p in head.parameters())
        print(f"head params: {n_params:,}", flush=True)
        trained = train(head, target, args, sha256)
        if args.bench:
            return
        save_head(head, target, args.out, sha256)
        for name in TOKENIZER_FILES:
            shutil.copyfile(args.target / name, args.out / name)
        record = {"params": n_params, "threads": 1, "minutes": args.minutes, "seed": args.seed,
                  "seq_len": args.seq_len, "batch": args.batch, "intermediate_size": args.intermediate,
                  "unroll": args.unroll, "feat_weight": args.feat_weight, "lr": args.lr,
                  "warmup_steps": args.warmup_steps, "min_lr_ratio": args.min_lr_ratio,
                  "weight_decay": args.weight_decay, "target": args.target.name, "target_weights_sha256": sha256,
                  **trained}
        record_path.write_text(json.dumps(record, indent=1) + "\n")  # training survives a failed measurement
    log = record.pop("log", [])
    record.update(measure(args, target))
    print("FINAL " + json.dumps(record), flush=True)
    record_path.write_text(json.dumps({**record, "log": log}, indent=1) + "\n")


if __name__ == "__main__":
    main()
