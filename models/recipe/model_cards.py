"""Write the model cards (README.md) of both bundled models from what the runs measured.

    python models/recipe/model_cards.py

Every number in a card comes from ``loss_curve.json`` (written by ``train.py``), ``distill.json`` (written by
``distill_draft.py``), the saved config, or the two samples this script generates (greedy, and seeded
temperature 0.8 / top-p 0.95) from the prompt ``def fibonacci(n):``. Nothing is typed in by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from prepare_data import HELDOUT_LIST, REPO_ROOT, TRAIN_LIST, read_list

MODELS = REPO_ROOT / "models"
TARGET, DRAFT = MODELS / "strata-moe-tiny", MODELS / "strata-draft-tiny"
PROMPT = "def fibonacci(n):"
REPRODUCE = """```bash
python models/recipe/prepare_data.py lists
python models/recipe/train_tokenizer.py --out models/strata-moe-tiny
python models/recipe/prepare_data.py tokenize --tokenizer models/strata-moe-tiny
{train_commands}
OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python models/recipe/distill_draft.py --minutes {draft_minutes}
python models/recipe/model_cards.py
```"""


def samples(path: Path) -> dict[str, str]:
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tok(PROMPT, return_tensors="pt").input_ids
    out = {}
    with torch.inference_mode():
        greedy = model.generate(ids, max_new_tokens=96, do_sample=False, repetition_penalty=1.0, temperature=None,
                                top_p=None, top_k=None)
        torch.manual_seed(0)
        sampled = model.generate(ids, max_new_tokens=96)  # the model's generation_config.json defaults
    out["greedy"] = tok.decode(greedy[0], skip_special_tokens=False)
    out["sampled"] = tok.decode(sampled[0], skip_special_tokens=False)
    return out


def defaults_text(path: Path) -> str:
    config = json.loads((path / "generation_config.json").read_text())
    if not config.get("do_sample"):
        return "greedy"
    return ", ".join(f"{k}={config[k]}" for k in ("temperature", "top_p", "top_k", "repetition_penalty") if k in config)


def sample_section(s: dict[str, str], path: Path) -> str:
    return (f"Prompt `{PROMPT}`, 96 new tokens, greedy:\n\n```python\n{s['greedy']}\n```\n\n"
            f"Same prompt, the defaults of `generation_config.json` ({defaults_text(path)}), "
            f"`torch.manual_seed(0)`:\n\n```python\n{s['sampled']}\n```\n")


def rope_theta(cfg: dict) -> float:
    """transformers 5 writes ``rope_parameters``; older configs a top-level ``rope_theta``."""
    return (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta"))


def num_experts(cfg: dict) -> int:
    return cfg.get("num_experts", cfg.get("num_local_experts"))


def size_mb(path: Path) -> float:
    return (path / "model.safetensors").stat().st_size / 1e6


def tokenizer_section() -> str:
    return ("Byte-level BPE, 4,096 tokens, trained with `tokenizers` on the train split "
            "(`models/recipe/train_tokenizer.py`). Special tokens: `<|endoftext|>` (id 0; eos and pad), "
            "`<|im_start|>` (1), `<|im_end|>` (2). No bos token is added. `tokenizer_config.json` carries a ChatML "
            "`chat_template`. Decoding round-trips any text byte for byte, indentation and tabs included.")


def data_section(curve: dict) -> str:
    return (f"The Python 3.11 standard library's own `.py` sources (test folders and `site-packages` excluded), "
            f"split by file with a hash of the path: {len(read_list(TRAIN_LIST))} train files, "
            f"{len(read_list(HELDOUT_LIST))} held-out files (lists in `models/recipe/`). "
            f"Train split: {curve['data']['train']['tokens']:,} tokens; held-out: "
            f"{curve['data']['heldout']['tokens']:,} tokens ({curve['data']['train']['bytes_per_token']:.2f} "
            f"bytes/token on train).")


def stages_of(curve: dict) -> list[dict]:
    """Every training stage (one when the model was never resumed)."""
    fin, a = curve["final"], curve["args"]
    return curve.get("stages") or [{"minutes": float(a["minutes"]), "lr": float(a["lr"]), "seed": int(a["seed"]),
                                     "warmup_steps": int(a["warmup_steps"]), "steps": fin["steps"],
                                     "tokens": fin["tokens"]}]


def train_commands(curve: dict) -> str:
    cmd = "OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python models/recipe/train.py"
    lines = []
    for i, st in enumerate(stages_of(curve)):
        extra = "" if i == 0 else f" --resume --seed {st['seed']} --lr {st['lr']:g} --warmup-steps {st['warmup_steps']}"
        lines.append(f"{cmd} --minutes {st['minutes']:g}{extra} --out models/strata-moe-tiny")
    return "\n".join(lines)


def stages_text(curve: dict) -> str:
    stages = stages_of(curve)
    if len(stages) == 1:
        return ""
    parts = [f"stage {i + 1}{' from scratch' if i == 0 else ' (`--resume`, fresh AdamW, from the weights before it)'}: "
             f"{st['minutes']:.1f} min, {st['tokens']:,} tokens, peak LR {st['lr']:g}, {st['warmup_steps']} warmup "
             f"steps, seed {st['seed']}" for i, st in enumerate(stages)]
    return "\n- Stages (each with its own warmup and cosine): " + "; ".join(parts) + "."


def target_card(curve: dict, cfg: dict, s: dict[str, str], draft: dict) -> str:
    fin, a = curve["final"], curve["args"]
    epochs = fin["tokens"] / curve["data"]["train"]["tokens"]
    heldout_rows = "\n".join(f"| {r['tokens']:,} | {r['seconds'] / 60:.1f} | {r['loss']:.3f} | {r['perplexity']:.1f} |"
                             for r in curve["heldout"])
    return f"""# strata-moe-tiny

A tiny Qwen3-MoE language model for Python source code, trained from scratch in {fin['train_seconds'] / 60:.0f}
minutes on one CPU thread. It is Strata's embedded default model: small enough to ship in the repository
({size_mb(TARGET):.1f} MB of bfloat16 safetensors) and to serve on any laptop, real enough to exercise every code
path a production MoE takes (router, top-k experts, GQA attention with q/k norms, RoPE, tied embeddings).
It is a demo and test model, not a useful assistant.

## Architecture

`Qwen3MoeForCausalLM` (loads with `transformers.AutoModelForCausalLM`).

| | |
|---|---|
| layers | {cfg['num_hidden_layers']} (all sparse MoE) |
| hidden size | {cfg['hidden_size']} |
| attention | {cfg['num_attention_heads']} query heads, {cfg['num_key_value_heads']} KV heads, head_dim {cfg['head_dim']}, RoPE theta {rope_theta(cfg):g} |
| experts | {num_experts(cfg)} per layer, top-{cfg['num_experts_per_tok']} (normalised), expert intermediate size {cfg['moe_intermediate_size']} |
| vocabulary | {cfg['vocab_size']}, embeddings tied to the LM head |
| max positions | {cfg['max_position_embeddings']} (trained on {a['seq_len']}-token windows) |
| parameters | **{curve['params_total']:,} total, {curve['params_active']:,} active per token** ({100 * curve['params_active'] / curve['params_total']:.0f}%) |
| weights | bfloat16 safetensors, {size_mb(TARGET):.1f} MB |

## Training

- Data: {data_section(curve)}
- Tokens seen: **{fin['tokens']:,}** ({fin['steps']:,} steps of {a['batch']} x {a['seq_len']} tokens, about {epochs:.1f} epochs).
- Wall clock: **{fin['train_seconds'] / 60:.1f} minutes** on **1 CPU thread** (`torch.set_num_threads(1)`) of an
  Intel Xeon with AMX, bf16 autocast, fp32 master weights; the machine's second core was shared with other work.
- AdamW (betas 0.9/0.95, weight decay {a['weight_decay']}), peak LR {a['lr']}, {a['warmup_steps']} warmup steps,
  cosine over the time budget down to {a['min_lr_ratio']} x peak, grad-norm clip 1.0, router load-balancing loss
  coefficient {cfg['router_aux_loss_coef']}, seed {a['seed']}.{stages_text(curve)}

## Results

- Final train loss (exponential moving average, 0.98): **{fin['train_loss_smoothed']:.3f}** nats/token.
- Held-out (all {fin['heldout_full_tokens']:,} held-out tokens, {a['seq_len']}-token windows):
  loss **{fin['heldout_full_loss']:.3f}**, perplexity **{fin['heldout_full_perplexity']:.1f}**.

![loss curve](loss_curve.png)

Held-out loss during training (fixed subset of {a['eval_windows']} windows):

| tokens seen | minutes | loss | perplexity |
|---|---|---|---|
{heldout_rows}

## Tokenizer

{tokenizer_section()}

## Samples

{sample_section(s, TARGET)}
## Intended use

Strata's embedded default (`strata serve` with no model argument), tests, benchmarks and demos of the serving
stack: prefix caching, tiered KV storage, MoE expert routing and (with `strata-draft-tiny`, top-1 agreement
{100 * draft['top1_agreement']:.0f}% on held-out text) speculative decoding.

## Limitations

- It knows only the style of the Python standard library; its code looks plausible and is usually wrong.
- Under plain greedy decoding it repeats itself (lines and blocks loop). Its `generation_config.json` therefore
  sets sampling defaults ({defaults_text(TARGET)}), which `strata generate` and `LLM()` apply to options left
  unset, as vLLM does with `--generation-config auto`.
- It was never trained on chat data: the ChatML template exists so chat endpoints work, not so it can chat.
- Trained on {a['seq_len']}-token windows; quality falls off past that length even though RoPE accepts 2048.
- Perplexities are on held-out stdlib files, which share authors and idioms with the train split.

## Reproduce

{REPRODUCE.format(train_commands=train_commands(curve), draft_minutes=draft['minutes'])}
"""


def draft_card(d: dict, cfg: dict, s: dict[str, str], curve: dict) -> str:
    return f"""# strata-draft-tiny

A tiny dense Qwen3 draft model for speculative decoding with `strata-moe-tiny`, distilled from it in
{d['train_seconds'] / 60:.0f} minutes on one CPU thread. Same tokenizer (byte-identical files).

## Architecture

`Qwen3ForCausalLM`: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, MLP intermediate
{cfg['intermediate_size']}, {cfg['num_attention_heads']} query heads / {cfg['num_key_value_heads']} KV head,
head_dim {cfg['head_dim']}, vocabulary {cfg['vocab_size']} with tied embeddings, max positions
{cfg['max_position_embeddings']}. **{d['params']:,} parameters**, bfloat16 safetensors, {size_mb(DRAFT):.1f} MB.

## Training

- Objective: KL(target || draft) over the full vocabulary at every position; the target runs under
  `torch.inference_mode` with bf16 autocast. No hard labels.
- Data: random {d['seq_len']}-token windows of the same train split as the target ({len(read_list(TRAIN_LIST))} stdlib files).
- Tokens seen: **{d['tokens']:,}** ({d['steps']:,} steps of {d['batch']} x {d['seq_len']}).
- Wall clock: **{d['train_seconds'] / 60:.1f} minutes** on **1 CPU thread** (Intel Xeon, AMX, bf16 autocast),
  target forward passes included. AdamW, peak LR {d['lr']}, warmup + cosine over the time budget.
- Final training KL: {d['final_kl']:.3f} nats/token.

## Results (all {d['heldout_tokens']:,} held-out tokens)

| | |
|---|---|
| draft perplexity | **{d['draft_heldout_perplexity']:.1f}** (target: {d['target_heldout_perplexity']:.1f}) |
| top-1 agreement with the target | **{100 * d['top1_agreement']:.1f}%** (greedy speculative decoding accepts a drafted token exactly when they agree) |
| expected acceptance at temperature 1 | **{100 * d['expected_acceptance_t1']:.1f}%** (mean of sum over the vocabulary of min(p_target, p_draft)) |

## Samples

{sample_section(s, DRAFT)}
## Intended use and limitations

Draft model for Strata's speculative-decoding path and its tests, paired with `strata-moe-tiny` only. On its own
it is a worse copy of a toy model: it repeats itself under greedy decoding and its code is not correct.

## Reproduce

See `models/README.md` (the draft needs the trained target).
"""


def main() -> None:
    meta = json.loads((REPO_ROOT / "runs" / "data" / "meta.json").read_text())
    curve = json.loads((TARGET / "loss_curve.json").read_text())
    curve["data"] = meta
    draft = json.loads((DRAFT / "distill.json").read_text())
    target_cfg = json.loads((TARGET / "config.json").read_text())
    draft_cfg = json.loads((DRAFT / "config.json").read_text())
    (TARGET / "README.md").write_text(target_card(curve, target_cfg, samples(TARGET), draft))
    (DRAFT / "README.md").write_text(draft_card(draft, draft_cfg, samples(DRAFT), curve))
    print(f"wrote {TARGET / 'README.md'} and {DRAFT / 'README.md'}")


if __name__ == "__main__":
    main()
