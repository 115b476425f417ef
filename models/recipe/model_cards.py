"""Write the model cards (README.md) of the bundled models from what the runs measured.

    python models/recipe/model_cards.py               # all three
    python models/recipe/model_cards.py --only eagle  # one of target, draft, eagle

Every number in a card comes from ``loss_curve.json`` (written by ``train.py``), ``distill.json`` (written by
``distill_draft.py``), ``eagle.json`` (written by ``train_eagle.py``), the saved config, or the two samples this
script generates (greedy, and seeded temperature 0.8 / top-p 0.95) from the prompt ``def fibonacci(n):``. Nothing
is typed in by hand.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from prepare_data import HELDOUT_LIST, REPO_ROOT, TRAIN_LIST, read_list

MODELS = REPO_ROOT / "models"
TARGET, DRAFT, EAGLE = MODELS / "strata-moe-tiny", MODELS / "strata-draft-tiny", MODELS / "strata-eagle-tiny"
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


def eagle_command(e: dict) -> str:
    return (f"OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python models/recipe/train_eagle.py --minutes {e['minutes']:g} "
            f"--seed {e['seed']} --unroll {e['unroll']} --feat-weight {e['feat_weight']:g} --intermediate "
            f"{e['intermediate_size']} --lr {e['lr']:g} \\\n    --target models/{e['target']} --out models/strata-eagle-tiny")


def multistep_rows(m: dict) -> str:
    e, d = m["eagle"]["p_first_j_match"], m["draft_model"]["p_first_j_match"]
    return "\n".join(f"| {j + 1} | {100 * e[j]:.1f}% | {100 * d[j]:.1f}% |" for j in range(len(e)))


def eagle_card(e: dict, cfg: dict, draft: dict) -> str:
    m = e["multistep"]
    k = m["draft_steps"]
    ea, da = m["eagle"], m["draft_model"]
    kl = ", ".join(f"step {i + 1}: {v:.3f}" for i, v in enumerate(e["final_kl"]))
    return f"""# strata-eagle-tiny

An EAGLE-style speculative-decoding draft head for `strata-moe-tiny`, trained in {e['train_seconds'] / 60:.0f}
minutes on one CPU thread. It is not a language model on its own: it reads the target's hidden features and
borrows the target's token embedding, final norm and LM head, so it only runs inside an engine that serves
`strata-moe-tiny` (the exact weights: `config.json` records their sha256). Same tokenizer (byte-identical files).

## Architecture (the checkpoint contract)

Notation: f_i is the target's **last decoder layer output at position i, before its final RMSNorm** (not HF's
`output_hidden_states[-1]`, which is after the norm); t_i the token at i.

1. x_i = `fc`(concat[embed(t_(i+1)), f_i]), `fc` = Linear(2 x {cfg['hidden_size']} -> {cfg['hidden_size']}, with bias); embed is the
   target's (frozen) token embedding.
2. g_i = one `Qwen3DecoderLayer` (transformers semantics) on x: RMSNorm, attention with per-head q/k RMSNorm,
   RoPE at position i (theta {cfg['rope_theta']:g}, default rope), {cfg['num_attention_heads']} query heads, {cfg['num_key_value_heads']} KV heads, head_dim {cfg['head_dim']}, causal over the
   head's own positions 0..i; residual; RMSNorm; SiLU-gated MLP, intermediate size **{cfg['intermediate_size']}**; residual.
3. g_i predicts f_(i+1); the draft logits for t_(i+2) are the target's lm_head(final_norm(g_i)).

Drafting after the target verified position n: (t_(n+1), f_n) -> g_n -> d_(n+2) = argmax; then (d_(n+2), g_n) ->
g_(n+1) -> d_(n+3); and so on, the head's own g replacing the target's features. Tensors (bfloat16 safetensors,
{size_mb(EAGLE):.1f} MB, **{e['params']:,} parameters**): `fc.weight`, `fc.bias` and `layers.0.*` with HF Qwen3 names
(`input_layernorm`, `self_attn.{{q,k,v,o}}_proj`, `self_attn.{{q,k}}_norm`, `post_attention_layernorm`,
`mlp.{{gate,up,down}}_proj`). `config.json` has `"architectures": ["StrataEagleHead"]`, the Qwen3 layer fields and
`eagle.target_weights_sha256`; it does not load with `transformers.AutoModel`.

## Training

- Initialisation: attention and both norms copied from the target's last layer (same shapes), MLP fresh,
  `fc` the identity on the feature half and a random token half scaled to the features' magnitude.
- Objective, per draft step: KL(target || draft) on the draft's logits for t_(n+2) (soft-label cross-entropy
  against the target's distribution, as for `strata-draft-tiny`) + {e['feat_weight']:g} x smooth-L1(g_n, f_(n+1)).
  **{e['unroll']} unrolled steps**: step 2 feeds the head its own step-1 output instead of the target's feature
  (training-time test, as in HASS / EAGLE-3), which is what drafting does from the second token on.
- The target runs under `torch.inference_mode` with bf16 autocast; the target is frozen throughout.
- Data: random {e['seq_len']}-token windows of the same train split as the target ({len(read_list(TRAIN_LIST))} stdlib files).
- Tokens seen: **{e['tokens']:,}** ({e['steps']:,} steps of {e['batch']} x {e['seq_len']}).
- Wall clock: **{e['train_seconds'] / 60:.1f} minutes** on **1 CPU thread** (Intel Xeon, AMX, bf16 autocast; the
  machine's second core was shared with other work), target forward passes included.
- AdamW (betas 0.9/0.95, weight decay {e['weight_decay']:g} on the layer's matrices, none on `fc`), peak LR {e['lr']:g},
  {e['warmup_steps']} warmup steps, cosine over the time budget down to {e['min_lr_ratio']:g} x peak, grad-norm clip 1.0, seed {e['seed']}.
- Final training KL (nats/token): {kl}.

## Results (held-out split; the shipped bfloat16 weights)

Step 1, teacher-forced target features, {e['step1_positions']:,} positions ({e['heldout_windows']} {e['seq_len']}-token windows; the
draft model's numbers count the predictions of t_1..t_512 of the same windows, the head's those of t_2..t_513):

| | strata-eagle-tiny | strata-draft-tiny (`distill.json`) |
|---|---|---|
| top-1 agreement with the target | **{100 * e['top1_agreement']:.1f}%** | {100 * draft['top1_agreement']:.1f}% |
| expected acceptance at temperature 1 (mean sum min(p_target, p_draft)) | **{100 * e['expected_acceptance_t1']:.1f}%** | {100 * draft['expected_acceptance_t1']:.1f}% |
| perplexity on the true tokens | {e['head_heldout_perplexity']:.1f} | {draft['draft_heldout_perplexity']:.1f} |

Multi-step greedy drafting, {ea['starts']:,} start positions ({m['windows']} evenly spaced held-out windows of
{m['seq_len']} tokens), the same starts for both drafters. Each drafts {k} tokens on its own outputs from context
t_0..t_(n+1); the target then verifies the chain as speculative decoding does (one pass over the context plus the
drafts), so its greedy token for draft j is conditioned on drafts 1..j-1.

| j | P(first j drafts all match), eagle head | same, `strata-draft-tiny` |
|---|---|---|
{multistep_rows(m)}

Expected tokens per target forward with greedy verification, 1 + sum over j <= k of P(first j match):
**{ea[f'accepted_per_forward_k{k - 1}']:.2f}** with {k - 1} drafts ({ea[f'accepted_per_forward_k{k}']:.2f} with {k}) for the head, against
{da[f'accepted_per_forward_k{k - 1}']:.2f} ({da[f'accepted_per_forward_k{k}']:.2f}) for `strata-draft-tiny`. The head is also cheaper per draft token: one decoder
layer on {cfg['hidden_size']} wide features against the draft model's {json.loads((DRAFT / 'config.json').read_text())['num_hidden_layers']} layers (both then pay one {cfg['vocab_size']}-way LM head).

## Intended use and limitations

Draft head for Strata's speculative-decoding path and its tests, with `strata-moe-tiny` only: any other target
(or other weights of it) gives it meaningless features. The numbers above are on held-out stdlib text, which
shares idioms with the train split; acceptance on the target's own free generations was not measured.

## Reproduce

```bash
python models/recipe/prepare_data.py tokenize --tokenizer models/strata-moe-tiny
{eagle_command(e)}
python models/recipe/model_cards.py --only eagle
```

Needs the trained target (see `models/README.md`). `--eval-only` re-measures a saved head.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("target", "draft", "eagle"), help="write just this card")
    only = parser.parse_args().only
    meta = json.loads((REPO_ROOT / "runs" / "data" / "meta.json").read_text())
    curve = json.loads((TARGET / "loss_curve.json").read_text())
    curve["data"] = meta
    draft = json.loads((DRAFT / "distill.json").read_text())
    target_cfg = json.loads((TARGET / "config.json").read_text())
    draft_cfg = json.loads((DRAFT / "config.json").read_text())
    if only in (None, "target"):
        (TARGET / "README.md").write_text(target_card(curve, target_cfg, samples(TARGET), draft))
    if only in (None, "draft"):
        (DRAFT / "README.md").write_text(draft_card(draft, draft_cfg, samples(DRAFT), curve))
    if only in (None, "eagle"):
        eagle = json.loads((EAGLE / "eagle.json").read_text())
        (EAGLE / "README.md").write_text(eagle_card(eagle, json.loads((EAGLE / "config.json").read_text()), draft))
    print(f"wrote the {only or 'target, draft and eagle'} card(s)")


if __name__ == "__main__":
    main()
