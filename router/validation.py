"""The one place a request becomes validated parameters (docs/api.md "Errors").

Both front doors (gRPC `Strata.Generate`, OpenAI HTTP) end up in `GenerateParams`; every rejection is an `ApiError`
that names the field and the allowed range, and carries the gRPC status it maps to. The shared checks and the gRPC
door live here, the OpenAI bodies' parsing in `router.openai_request`:

    grpc GenerateRequest --from_grpc-----------\
    POST /v1/completions --from_completion------>  GenerateParams  --check_prompt--> SamplingParams (max_tokens fitted)
    POST /v1/chat/completions --from_chat------/

Field names follow each door's spelling: `sampling.top_p` over gRPC, `top_p` over HTTP.
"""
from __future__ import annotations

import hashlib
import math
import random
import uuid
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

import grpc

from engine.sampling_params import (MAX_LOGPROBS, MIN_REPETITION_PENALTY, MIN_TEMPERATURE, MIN_TOP_P,
                                    SPECULATIVE_CHOICES, SamplingParams)

DEFAULT_MAX_TOKENS = 64
MAX_TEMPERATURE = 100.0
MAX_SEED = 2**63
MAX_REQUEST_ID_LEN = 256
# NOTE: the sampler divides logits by the temperature in float32: below ~1e-10 it draws wrong tokens, below
# float32's range it failed the engine step (the fuzz found 2.2e-313). A temperature under MIN_TEMPERATURE is greedy
# (vLLM's _SAMPLING_EPS); a top_p under MIN_TOP_P is MIN_TOP_P, which keeps the same single most likely token (its
# probability is at least 1 / vocab). `SamplingParams` applies the same rules wherever a request comes from.
MAX_UINT32 = 2**32 - 1         # the wire type of top_k, min_tokens and token ids (strata.proto)
# Bounds on list-like options (vLLM has none; a client that sends thousands is broken or hostile, and every stop
# string is checked at every token): OpenAI allows 4 stop strings, we allow more.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024
MAX_CACHE_SALT_LEN = 1024
# A request's size on the wire, either door (`--max-request-bytes`): an HTTP body over it is a 413, a gRPC message
# RESOURCE_EXHAUSTED. gRPC's own default; a max_model_len of token ids as JSON is far below it.
MAX_REQUEST_BYTES = 4 << 20


class ApiError(Exception):
    """A request the router refuses. `param` names the field (None when no single field is at fault);
    `retry_after_s`: when to try again (overload), sent as `grpc-retry-pushback-ms` / HTTP `Retry-After`."""

    def __init__(self, code: grpc.StatusCode, message: str, param: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param, self.retry_after_s = code, message, param, retry_after_s


def invalid(param: str, message: str) -> ApiError:
    return ApiError(grpc.StatusCode.INVALID_ARGUMENT, message, param)


@dataclass(frozen=True)
class ModelLimits:
    """What validation needs to know about a served model."""

    id: str
    max_model_len: int
    vocab_size: int
    # The checkpoint's generation_config.json sampling defaults ((name, value) pairs: temperature, top_k, top_p,
    # repetition_penalty), used by the OpenAI door for options a request leaves out, as vLLM does.
    sampling_defaults: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class GenerateParams:
    """A validated generation request. Exactly one of `prompt_text` / `prompt_ids` is set (chat is templated to
    text before it gets here). `max_tokens_explicit` tells `check_prompt` whether it may shorten max_tokens."""

    model: str
    prompt_text: str | None
    prompt_ids: tuple[int, ...] | None
    sampling: SamplingParams
    max_tokens_explicit: bool
    request_id: str
    cache_salt: str = ""
    skip_text: bool = False
    include_prompt_token_ids: bool = False
    include_metrics: bool = False
    add_special_tokens: bool = True


# ------------------------------------------------------------------------------------------------ shared checks

def resolve_model(name: str, models: Mapping[str, ModelLimits], param: str = "model") -> ModelLimits:
    """Empty name = the only model served."""
    if not name:
        if len(models) == 1:
            return next(iter(models.values()))
        raise invalid(param, f"{param} must be set: this router serves {sorted(models)}")
    model = models.get(name)
    if model is None:
        raise ApiError(grpc.StatusCode.NOT_FOUND, f"{param} {name!r} is not served here; served: {sorted(models)}",
                       param)
    return model


def build_sampling(prefix: str, *, max_tokens: int | None, temperature: float, top_p: float | None, top_k: int,
                   seed: int | None, stop: Sequence[str], stop_token_ids: Sequence[int], ignore_eos: bool,
                   include_stop_str_in_output: bool, draw_seed: Callable[[], int] | None = None,
                   repetition_penalty: float | None = None, presence_penalty: float = 0.0,
                   frequency_penalty: float = 0.0, logprobs: int | None = None,
                   logprobs_param: str = "logprobs", logit_bias: Mapping[int, float] | None = None,
                   min_tokens: int = 0, prompt_logprobs: int | None = None,
                   prompt_logprobs_param: str = "prompt_logprobs", speculative: str | None = None,
                   max_model_len: int | None = None) -> SamplingParams:
    """Range checks with the door's field names; an unset seed is drawn here, so a retry on another worker
    continues the same random stream (docs/api.md: "the same tokens on any worker, after a failover too").
    `max_model_len`: the model's, which an explicit max_tokens must leave room below for one prompt token."""
    if max_tokens is not None and max_tokens < 1:
        raise invalid(f"{prefix}max_tokens", f"{prefix}max_tokens must be >= 1, got {max_tokens}")
    if max_tokens is not None and max_model_len is not None and max_tokens >= max_model_len:
        raise invalid(f"{prefix}max_tokens", f"{prefix}max_tokens must be in [1, {max_model_len - 1}] (below the "
                                             f"model's max_model_len {max_model_len}), got {max_tokens}")
    if not (math.isfinite(temperature) and 0.0 <= temperature <= MAX_TEMPERATURE):
        raise invalid(f"{prefix}temperature",
                      f"{prefix}temperature must be in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got {temperature}")
    if top_p is not None and not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise invalid(f"{prefix}top_p", f"{prefix}top_p must be in (0, 1], got {top_p}")
    if not 0 <= top_k <= MAX_UINT32:
        raise invalid(f"{prefix}top_k", f"{prefix}top_k must be in [0, {MAX_UINT32}] (0 = off), got {top_k}")
    if repetition_penalty is not None and not (math.isfinite(repetition_penalty)
                                               and MIN_REPETITION_PENALTY <= repetition_penalty <= 10):
        raise invalid(f"{prefix}repetition_penalty",
                      f"{prefix}repetition_penalty must be in [{MIN_REPETITION_PENALTY}, 10] (1 = off), got "
                      f"{repetition_penalty}")
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not (math.isfinite(value) and -2.0 <= value <= 2.0):
            raise invalid(f"{prefix}{name}", f"{prefix}{name} must be in [-2, 2] (0 = off), got {value}")
    if seed is not None and not 0 <= seed < MAX_SEED:
        raise invalid(f"{prefix}seed", f"{prefix}seed must be in [0, 2**63), got {seed}")
    if not 0 <= min_tokens <= (max_tokens or DEFAULT_MAX_TOKENS):
        raise invalid(f"{prefix}min_tokens", f"{prefix}min_tokens must be in [0, max_tokens="
                                             f"{max_tokens or DEFAULT_MAX_TOKENS}], got {min_tokens}")
    for value, param in ((logprobs, logprobs_param), (prompt_logprobs, prompt_logprobs_param)):
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise invalid(f"{prefix}{param}", f"{prefix}{param} must be in [0, {MAX_LOGPROBS}], got {value}")
    check_sizes(prefix, stop, stop_token_ids, logit_bias or {})
    for token_id, value in (logit_bias or {}).items():
        if token_id < 0 or not (math.isfinite(value) and -100.0 <= value <= 100.0):
            raise invalid(f"{prefix}logit_bias", f"{prefix}logit_bias must map token ids >= 0 to values in "
                                                 f"[-100, 100], got {token_id}: {value}")
    if any(not isinstance(s, str) or not s for s in stop):
        raise invalid(f"{prefix}stop", f"{prefix}stop strings must be non-empty strings, got {list(stop)!r}")
    check_speculative(speculative, f"{prefix}speculative")
    if seed is None and draw_seed is not None:
        seed = draw_seed()
    temperature = 0.0 if temperature < MIN_TEMPERATURE else float(temperature)
    return SamplingParams(max_tokens=max_tokens or DEFAULT_MAX_TOKENS, temperature=temperature,
                          top_k=top_k, top_p=1.0 if top_p is None else max(float(top_p), MIN_TOP_P), seed=seed,
                          stop=tuple(stop),
                          stop_token_ids=tuple(stop_token_ids), ignore_eos=ignore_eos,
                          include_stop_str_in_output=include_stop_str_in_output,
                          repetition_penalty=1.0 if repetition_penalty is None else float(repetition_penalty),
                          presence_penalty=float(presence_penalty), frequency_penalty=float(frequency_penalty),
                          logprobs=logprobs, logit_bias=tuple((logit_bias or {}).items()),
                          min_tokens=min_tokens, prompt_logprobs=prompt_logprobs, speculative=speculative)


def check_sizes(prefix: str, stop: Sequence[str], stop_token_ids: Sequence[int],
                logit_bias: Mapping[int, float]) -> None:
    """The list-like options' bounds (MAX_STOP_STRINGS and the rest), before their items are looked at."""
    for name, items, limit in (("stop", stop, MAX_STOP_STRINGS), ("stop_token_ids", stop_token_ids,
                                                                  MAX_STOP_TOKEN_IDS),
                               ("logit_bias", logit_bias, MAX_LOGIT_BIAS)):
        if len(items) > limit:
            raise invalid(f"{prefix}{name}", f"{prefix}{name} holds {len(items)} entries; at most {limit}")
    long = next((s for s in stop if isinstance(s, str) and len(s) > MAX_STOP_CHARS), None)
    if long is not None:
        raise invalid(f"{prefix}stop", f"{prefix}stop strings must be at most {MAX_STOP_CHARS} characters, got "
                                       f"{len(long)}")


def check_cache_salt(cache_salt: str, param: str = "cache_salt") -> str:
    if len(cache_salt) > MAX_CACHE_SALT_LEN:
        raise invalid(param, f"{param} must be at most {MAX_CACHE_SALT_LEN} characters, got {len(cache_salt)}")
    return cache_salt


def check_speculative(value: str | None, param: str) -> str | None:
    """A request's drafter: unset (the decode worker's own), "off", or one a decode worker may have loaded (whether
    one did is the dispatcher's check, once the workers are known: `Dispatcher.start`)."""
    if value is not None and value not in SPECULATIVE_CHOICES:
        raise invalid(param, f"{param} must be one of {', '.join(SPECULATIVE_CHOICES)} (or unset: the decode "
                             f"worker's own), got {value!r}")
    return value


def check_request_id(request_id: str, param: str = "request_id") -> str:
    if len(request_id) > MAX_REQUEST_ID_LEN:
        raise invalid(param, f"{param} must be at most {MAX_REQUEST_ID_LEN} characters, got {len(request_id)}")
    return request_id or uuid.uuid4().hex


def check_prompt(params: GenerateParams, token_ids: Sequence[int], model: ModelLimits,
                 ids_param: str = "prompt.token_ids", prompt_param: str = "prompt",
                 bias_param: str = "logit_bias", stop_ids_param: str = "stop_token_ids") -> SamplingParams:
    """Token-level checks once the prompt is tokenized; returns the sampling params with max_tokens fitted.

    An explicit max_tokens that does not fit is an error; the default is shortened to the room left.
    """
    if not token_ids:
        raise invalid(prompt_param, f"{prompt_param} must not be empty")
    if min(token_ids) < 0 or max(token_ids) >= model.vocab_size:  # NOTE: a scan in Python is ~0.1 ms per 2k tokens
        bad = next(t for t in token_ids if not 0 <= t < model.vocab_size)
        raise invalid(ids_param, f"{ids_param} must be in [0, {model.vocab_size}), got {bad}")
    sampling = params.sampling
    bad = next((t for t, _ in sampling.logit_bias if t >= model.vocab_size), None)
    if bad is not None:
        raise invalid(bias_param, f"{bias_param} token ids must be in [0, {model.vocab_size}), got {bad}")
    bad = next((t for t in sampling.stop_token_ids if not 0 <= t < model.vocab_size), None)
    if bad is not None:
        raise invalid(stop_ids_param, f"{stop_ids_param} must be in [0, {model.vocab_size}), got {bad}")
    room = model.max_model_len - len(token_ids)
    if room < 1:
        raise invalid(prompt_param, f"{prompt_param}: {len(token_ids)} tokens leave no room below max_model_len "
                                    f"{model.max_model_len}")
    if sampling.max_tokens > room:
        if params.max_tokens_explicit:
            raise invalid(prompt_param, f"{prompt_param}: {len(token_ids)} tokens + max_tokens {sampling.max_tokens} "
                                        f"exceed max_model_len {model.max_model_len}")
        sampling = replace(sampling, max_tokens=room, min_tokens=min(sampling.min_tokens, room))
    return sampling


def effective_salt(cache_salt: str, identity: str, isolated: bool = False) -> str:
    """The salt the workers hash with (DESIGN §3): the caller's salt bound to the caller's identity, so a salt
    alone never opens another tenant's prefixes. No salt = the shared public namespace, unless `isolated` (an
    authenticated tenant, `router.auth`): then every request is salted from its identity, a salt or not."""
    if not cache_salt and not isolated:
        return ""
    return hashlib.blake2b(f"{identity}\0{cache_salt}".encode(), digest_size=16).hexdigest()


def draw_seed() -> int:
    return random.SystemRandom().randrange(MAX_SEED)


# ---------------------------------------------------------------------------------------------------------- gRPC

def from_grpc(request: Any, models: Mapping[str, ModelLimits]) -> GenerateParams:
    """`strata_pb2.GenerateRequest` -> GenerateParams. Field names as in strata.proto."""
    model = resolve_model(request.model, models)
    kind = request.WhichOneof("prompt")
    if kind is None or (kind == "text" and not request.text) or (kind == "token_ids" and not request.token_ids.ids):
        raise invalid("prompt", "prompt must not be empty: set text or token_ids")
    s = request.sampling
    sampling = build_sampling(
        "sampling.", max_tokens=s.max_tokens if s.HasField("max_tokens") else None, temperature=s.temperature,
        top_p=s.top_p if s.HasField("top_p") else None, top_k=s.top_k, seed=s.seed if s.HasField("seed") else None,
        stop=list(s.stop), stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos,
        include_stop_str_in_output=s.include_stop_str_in_output, draw_seed=draw_seed,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else None,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        logprobs=s.logprobs if s.HasField("logprobs") else None, logit_bias=dict(s.logit_bias),
        min_tokens=s.min_tokens, prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
        speculative=s.speculative or None, max_model_len=model.max_model_len)
    opts = request.stream_options
    return GenerateParams(
        model=model.id, prompt_text=request.text if kind == "text" else None,
        prompt_ids=tuple(request.token_ids.ids) if kind == "token_ids" else None, sampling=sampling,
        max_tokens_explicit=s.HasField("max_tokens"), request_id=check_request_id(request.request_id),
        cache_salt=check_cache_salt(request.cache_salt), skip_text=opts.skip_text,
        include_prompt_token_ids=opts.include_prompt_token_ids, include_metrics=opts.include_metrics)
