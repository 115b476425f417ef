"""Per-request sampling settings, validated on construction (errors name the field and the allowed range)."""
from __future__ import annotations

import enum
from dataclasses import dataclass

MAX_LOGPROBS = 20  # as vLLM's default max_logprobs and OpenAI's top_logprobs bound
SPECULATIVE_CHOICES = ("off", "ngram", "draft", "eagle")   # a request's `speculative` (engine.config's methods)
# Below these the float32 sampler overflows: a temperature is greedy, a top_p keeps the top token alone, and a
# repetition penalty is refused (a seen token's logit divided by less is inf).
MIN_TEMPERATURE, MIN_TOP_P, MIN_REPETITION_PENALTY = 1e-5, 1e-8, 0.01


class RequestOutputKind(enum.Enum):
    """Which outputs `LLMEngine.step()` hands back for a request (vLLM's names).

    CUMULATIVE: one per step that sampled, with the step's new tokens and text and everything so far (a stream).
    FINAL_ONLY: one, when the request finishes, with everything in `new_*` too; no text is decoded before then
    unless stop strings need it (the offline `generate`).
    """

    CUMULATIVE = "cumulative"
    FINAL_ONLY = "final_only"


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0          # 0 means greedy
    top_k: int = 0                    # 0 means off
    top_p: float = 1.0                # 1 means off
    repetition_penalty: float = 1.0   # 1 means off; > 1 discourages tokens already in the prompt or the output
    presence_penalty: float = 0.0     # OpenAI's: minus this once for every token already in the output
    frequency_penalty: float = 0.0    # OpenAI's: minus this times the token's count in the output
    seed: int | None = None           # per-request seed: the same tokens wherever the request runs
    stop: tuple[str, ...] = ()        # stop strings (not included in the output)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None       # per output token: its log probability and the N most likely (0 = its own)
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, added to its logit in [-100, 100]); a dict works
    min_tokens: int = 0               # no end-of-sequence, stop token or stop string before this many outputs
    prompt_logprobs: int | None = None   # per prompt token after the first: its logprob and the N most likely
    min_p: float = 0.0                # 0 means off; drops tokens less likely than min_p times the most likely one
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE   # a string ("final_only") works
    speculative: str | None = None    # None: the server's drafter; "off", or one the server loaded (ngram always)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        if not (0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        if not (MIN_REPETITION_PENALTY <= self.repetition_penalty <= 10.0):
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, 10] (1 = off), got "
                             f"{self.repetition_penalty!r}")
        # NOTE: past these the float32 sampler overflows (inf logits, an empty nucleus): one step broke on them
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)            # greedy, as the limit is
        if self.top_p < MIN_TOP_P:
            object.__setattr__(self, "top_p", MIN_TOP_P)            # the top token alone, as the limit is
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-2.0 <= getattr(self, name) <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)!r}")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (or unset), got {self.logprobs!r}")
        if self.prompt_logprobs is not None and not (isinstance(self.prompt_logprobs, int)
                                                     and 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}] (or unset), got "
                             f"{self.prompt_logprobs!r}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed!r}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        bias = tuple(sorted((int(t), float(b)) for t, b in bias))
        for token_id, value in bias:
            if token_id < 0 or not (-100.0 <= value <= 100.0):
                raise ValueError(f"logit_bias must map token ids >= 0 to values in [-100, 100], got "
                                 f"{token_id}: {value}")
        object.__setattr__(self, "logit_bias", bias)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.speculative is not None and self.speculative not in SPECULATIVE_CHOICES:
            raise ValueError(f"speculative must be one of {SPECULATIVE_CHOICES} (or unset: the server's), got "
                             f"{self.speculative!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            kinds = {k.value: k for k in RequestOutputKind}
            if self.output_kind not in kinds:
                raise ValueError(f"output_kind must be one of {sorted(kinds)}, got {self.output_kind!r}")
            object.__setattr__(self, "output_kind", kinds[self.output_kind])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether logits depend on the tokens seen so far (then the sampler needs them)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler draws from a rewritten copy of the logits (penalties or a logit bias)."""
        return self.penalized or bool(self.logit_bias)

    # The generation_config.json keys a model may set as its defaults (vLLM's `--generation-config auto`).
    DEFAULT_KEYS = ("temperature", "top_k", "top_p", "repetition_penalty")

    @classmethod
    def from_generation_config(cls, generation_config: dict, **overrides) -> "SamplingParams":
        """The model's own defaults (only the keys above; `do_sample: false` means greedy), then `overrides` on top
        (a None override keeps the default)."""
        values = {k: generation_config[k] for k in cls.DEFAULT_KEYS if generation_config.get(k) is not None}
        if not generation_config.get("do_sample", False):
            values.pop("temperature", None)
        max_new = generation_config.get("max_new_tokens")
        if isinstance(max_new, int) and max_new > 0:
            values["max_tokens"] = max_new
        values.update((k, v) for k, v in overrides.items() if v is not None)
        return cls(**values)
