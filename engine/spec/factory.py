"""`build_speculation`: the drafters a server runs, from its `SpeculativeConfig`. `ngram` is always loaded (it
costs nothing), so any request may ask for it; `draft` and `eagle` only when the server was started with them."""
from __future__ import annotations

from engine.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from engine.spec.drafter import Drafter
from engine.spec.ngram import NgramDrafter
from engine.spec.speculation import Speculation


def build_speculation(config: SpeculativeConfig, runner, model_config: ModelConfig, cache_config: CacheConfig,
                      scheduler_config: SchedulerConfig) -> Speculation | None:
    """`runner`: the target's ModelRunner. `config.draft_model` must be a resolved folder for draft / eagle."""
    if not config.enabled:
        return None
    drafters: dict[str, Drafter] = {"ngram": NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)}
    if config.method in ("draft", "eagle") and not config.draft_model:
        raise ValueError(f"speculative method {config.method!r} needs a draft_model folder")
    if config.method == "draft":
        from engine.spec.draft_model import DraftModelDrafter
        draft_config = ModelConfig(config.draft_model, model_config.device, model_config.dtype, model_config.seed,
                                   model_config.enforce_eager)
        drafters["draft"] = DraftModelDrafter(draft_config, cache_config, runner.vocab_size,
                                              scheduler_config.max_num_seqs, model_config.seed,
                                              config.num_speculative_tokens, scheduler_config.max_model_len)
    elif config.method == "eagle":
        from engine.spec.eagle import EagleDrafter
        drafters["eagle"] = EagleDrafter(config.draft_model, runner.model, model_config.dtype, model_config.device,
                                         cache_config.num_blocks, cache_config.block_size, model_config.seed,
                                         model_config.path)
    speculation = Speculation(config, drafters, model_config.seed)
    plain, verify = getattr(runner, "compiled", None), getattr(runner, "compiled_verify", None)
    if plain is not None and verify is not None:  # compiled: their warm-up timed both kinds of step
        speculation.controller.seed(plain.warm_seconds, verify.warm_seconds)
    return speculation
