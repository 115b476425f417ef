"""The speculative-decoding options every entry point takes alike: `strata serve` (for its decode workers),
`strata generate`, and the worker CLIs (`--speculative ngram|draft|eagle`, `--num-speculative-tokens N`,
`--speculative-model PATH`, `--no-speculative-adaptive`). They are checked here once, so each door refuses a bad
value with the same words, naming the option and what it allows, before any model loads.

No torch here: the launcher (`strata serve`'s parent process) checks the options without loading an engine.
"""
from __future__ import annotations

import dataclasses

from engine.config import MAX_SPECULATIVE_TOKENS, SPECULATIVE_METHODS, SpeculativeConfig
from strata.paths import resolve_draft_model

DEFAULT_NUM_SPECULATIVE_TOKENS = SpeculativeConfig().num_speculative_tokens
METHODS_HELP = ", ".join(SPECULATIVE_METHODS)


def check_method(value: str | None) -> str | None:
    """`--speculative`: one of the drafters, or None (off)."""
    if value is not None and value not in SPECULATIVE_METHODS:
        raise ValueError(f"must be one of {METHODS_HELP}, got {value!r}")
    return value


def check_num_tokens(value: int) -> int:
    """`--num-speculative-tokens`: the most tokens proposed per request and step."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {value!r}")
    return value


def speculative_config(method: str | None, num_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS,
                       model: str | None = None, adaptive: bool = True) -> SpeculativeConfig:
    """The engine's config for these options, its drafter's folder resolved; a ValueError names the field."""
    for name, check, value in (("speculative", check_method, method),
                               ("num_speculative_tokens", check_num_tokens, num_tokens)):
        try:
            check(value)
        except ValueError as exc:
            raise ValueError(f"{name} {exc}") from None
    if model and method not in ("draft", "eagle"):
        raise ValueError(f"speculative_model is only used with speculative 'draft' or 'eagle', got "
                         f"speculative={method!r}")
    config = SpeculativeConfig(method, num_tokens, adaptive=adaptive)
    return dataclasses.replace(config, draft_model=resolve_draft_model(method, model))


def worker_args(method: str | None, num_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS, model: str | None = None,
                adaptive: bool = True) -> list[str]:
    """The worker CLI flags for these options (nothing when speculation is off)."""
    if method is None:
        return []
    args = ["--speculative", method, "--num-speculative-tokens", str(num_tokens)]
    if model:
        args += ["--speculative-model", model]
    return args + ([] if adaptive else ["--no-speculative-adaptive"])
