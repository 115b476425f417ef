"""The `strata` command line."""
from __future__ import annotations

import sys
from typing import Optional

import typer

from strata.cli_serve import (ADAPTIVE_HELP, NUM_SPECULATIVE_HELP, QUANTIZE_VOCAB_HELP, SPECULATIVE_HELP,
                              SPECULATIVE_MODEL_HELP, check_num_speculative_tokens, check_speculative)
from strata.speculative_options import DEFAULT_NUM_SPECULATIVE_TOKENS

app = typer.Typer(help="Strata: disaggregated LLM serving with a tiered, pooled KV-cache store.",
                  no_args_is_help=True, add_completion=False)


@app.callback()
def main() -> None:
    """Strata's command line."""


def _mount() -> None:
    """`strata serve`, `strata cache stats|evict|flush`, `strata workers` and `strata worker add|remove|list` live in
    their own modules."""
    from strata.cli_cache import cache_app, workers
    from strata.cli_serve import scale, serve
    from strata.cli_worker import worker_app

    app.command("serve")(serve)
    app.command("scale")(scale)
    app.add_typer(cache_app, name="cache")
    app.command("workers")(workers)
    app.add_typer(worker_app, name="worker")


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="the prompt text"),
    model: Optional[str] = typer.Option(None, help="model folder (default: the bundled strata-moe-tiny)"),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="tokens to generate at most"),
    temperature: Optional[float] = typer.Option(None, help="0 = greedy"),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="0 = off"),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="1 = off"),
    repetition_penalty: Optional[float] = typer.Option(None, "--repetition-penalty", help="1 = off"),
    presence_penalty: Optional[float] = typer.Option(None, "--presence-penalty", help="0 = off"),
    frequency_penalty: Optional[float] = typer.Option(None, "--frequency-penalty", help="0 = off"),
    seed: Optional[int] = typer.Option(None, help="per-request sampling seed"),
    stop: list[str] = typer.Option([], help="stop string (repeatable)"),
    device: str = typer.Option("cpu", help="cpu, cuda or cuda:N"),
    dtype: str = typer.Option("float32", help="float32, bfloat16 or float16"),
    enforce_eager: bool = typer.Option(False, "--enforce-eager", help="do not compile the decode step"),
    quantization: Optional[str] = typer.Option(None, "--quantization",
                                               help="weights: int8, int4, fp8 or mxfp4 (default: the checkpoint's)"),
    quant_group_size: int = typer.Option(128, "--quant-group-size", help="int4 group size: 32, 64 or 128"),
    quantize_vocab: bool = typer.Option(False, "--quantize-vocab", help=QUANTIZE_VOCAB_HELP),
    kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype", help="KV cache: auto, fp8 or int8"),
    speculative: Optional[str] = typer.Option(None, "--speculative", callback=check_speculative,
                                              help=SPECULATIVE_HELP),
    num_speculative_tokens: int = typer.Option(DEFAULT_NUM_SPECULATIVE_TOKENS, "--num-speculative-tokens",
                                               callback=check_num_speculative_tokens, help=NUM_SPECULATIVE_HELP),
    speculative_model: Optional[str] = typer.Option(None, "--speculative-model", help=SPECULATIVE_MODEL_HELP),
    no_speculative_adaptive: bool = typer.Option(False, "--no-speculative-adaptive", help=ADAPTIVE_HELP),
) -> None:
    """Generate a continuation of PROMPT, streaming it to stdout. Sampling options left out take the model's
    generation_config.json defaults (greedy where it sets none)."""
    from strata.llm import LLM
    from strata.speculative_options import speculative_config

    try:
        spec = speculative_config(speculative, num_speculative_tokens, speculative_model, not no_speculative_adaptive)
        llm = LLM(model, device=device, dtype=dtype, max_num_seqs=1, enforce_eager=True if enforce_eager else None,
                  quantization=quantization, quant_group_size=quant_group_size, quantize_vocab=quantize_vocab,
                  kv_cache_dtype=kv_cache_dtype, speculative=speculative, num_speculative_tokens=num_speculative_tokens,
                  speculative_model=spec.draft_model, speculative_adaptive=spec.adaptive)
        params = llm.default_sampling_params(
            max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, seed=seed, stop=tuple(stop))
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    sys.stdout.write(prompt)
    for out in llm.stream(prompt, params):
        sys.stdout.write(out.new_text)
        sys.stdout.flush()
    sys.stdout.write("\n")


_mount()

if __name__ == "__main__":
    app()
