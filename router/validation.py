"""The one place a request becomes validated parameters (docs/api.md "Errors").

Both front doors (gRPC `Strata.Generate`, OpenAI HTTP) end up in `GenerateParams`; every rejection is an `ApiError`
that names the field and the allowed range, and carries the gRPC status it maps to:

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
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import grpc

from engine.sampling_params import MAX_LOGPROBS, SamplingParams

DEFAULT_MAX_TOKENS = 64
MAX_TEMPERATURE = 100.0
MAX_SEED = 2**63
MAX_REQUEST_ID_LEN = 256
MAX_CHOICES = 16             # OpenAI's n
MAX_BATCH_PROMPTS = 64       # completion prompts x choices in one request
_CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


class ApiError(Exception):
    """A request the router refuses. `param` names the field (None when no single field is at fault)."""

    def __init__(self, code: grpc.StatusCode, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


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


@dataclass(frozen=True)
class OpenAIOptions:
    """What the HTTP layer needs besides the generation itself."""

    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    chat: bool = False
    n: int = 1                     # choices per request: n runs of the prompt, seeds seed, seed + 1, ...
    messages: tuple[dict, ...] = field(default_factory=tuple)
    # a batch of completion prompts, (text, token ids) each; empty: the one prompt of the GenerateParams
    prompts: tuple[tuple[str | None, tuple[int, ...] | None], ...] = ()

    @property
    def num_choices(self) -> int:
        return max(1, len(self.prompts)) * self.n


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
                   prompt_logprobs_param: str = "prompt_logprobs") -> SamplingParams:
    """Range checks with the door's field names; an unset seed is drawn here, so a retry on another worker
    continues the same random stream (docs/api.md: "the same tokens on any worker, after a failover too")."""
    if max_tokens is not None and max_tokens < 1:
        raise invalid(f"{prefix}max_tokens", f"{prefix}max_tokens must be >= 1, got {max_tokens}")
    if not (math.isfinite(temperature) and 0.0 <= temperature <= MAX_TEMPERATURE):
        raise invalid(f"{prefix}temperature",
                      f"{prefix}temperature must be in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got {temperature}")
    if top_p is not None and not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise invalid(f"{prefix}top_p", f"{prefix}top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise invalid(f"{prefix}top_k", f"{prefix}top_k must be >= 0 (0 = off), got {top_k}")
    if repetition_penalty is not None and not (math.isfinite(repetition_penalty) and 0.0 < repetition_penalty <= 10):
        raise invalid(f"{prefix}repetition_penalty",
                      f"{prefix}repetition_penalty must be in (0, 10] (1 = off), got {repetition_penalty}")
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
    for token_id, value in (logit_bias or {}).items():
        if token_id < 0 or not (math.isfinite(value) and -100.0 <= value <= 100.0):
            raise invalid(f"{prefix}logit_bias", f"{prefix}logit_bias must map token ids >= 0 to values in "
                                                 f"[-100, 100], got {token_id}: {value}")
    if any(not isinstance(s, str) or not s for s in stop):
        raise invalid(f"{prefix}stop", f"{prefix}stop strings must be non-empty strings, got {list(stop)!r}")
    if seed is None and draw_seed is not None:
        seed = draw_seed()
    return SamplingParams(max_tokens=max_tokens or DEFAULT_MAX_TOKENS, temperature=float(temperature),
                          top_k=top_k, top_p=1.0 if top_p is None else float(top_p), seed=seed, stop=tuple(stop),
                          stop_token_ids=tuple(stop_token_ids), ignore_eos=ignore_eos,
                          include_stop_str_in_output=include_stop_str_in_output,
                          repetition_penalty=1.0 if repetition_penalty is None else float(repetition_penalty),
                          presence_penalty=float(presence_penalty), frequency_penalty=float(frequency_penalty),
                          logprobs=logprobs, logit_bias=tuple((logit_bias or {}).items()),
                          min_tokens=min_tokens, prompt_logprobs=prompt_logprobs)


def batch_params(params: GenerateParams, options: OpenAIOptions) -> list[GenerateParams]:
    """Every run of a request, in choice order: prompt by prompt, then choice by choice (index = prompt * n + i)."""
    if not options.prompts:
        return choice_params(params, options.n)
    runs = []
    for i, (text, ids) in enumerate(options.prompts):
        one = replace(params, prompt_text=text, prompt_ids=ids, request_id=f"{params.request_id}-p{i}")
        runs.extend(choice_params(one, options.n))
    return runs


def choice_params(params: GenerateParams, n: int) -> list[GenerateParams]:
    """The runs of an n-choice request: ids `<id>-<i>` and seeds seed + i (each choice reproducible on its own;
    greedy choices are identical, as in vLLM). One choice is the request itself."""
    if n == 1:
        return [params]
    seed = params.sampling.seed or 0
    return [replace(params, request_id=f"{params.request_id}-{i}",
                    sampling=replace(params.sampling, seed=(seed + i) % MAX_SEED)) for i in range(n)]


def check_request_id(request_id: str, param: str = "request_id") -> str:
    if len(request_id) > MAX_REQUEST_ID_LEN:
        raise invalid(param, f"{param} must be at most {MAX_REQUEST_ID_LEN} characters, got {len(request_id)}")
    return request_id or uuid.uuid4().hex


def check_prompt(params: GenerateParams, token_ids: Sequence[int], model: ModelLimits,
                 ids_param: str = "prompt.token_ids", prompt_param: str = "prompt",
                 bias_param: str = "logit_bias") -> SamplingParams:
    """Token-level checks once the prompt is tokenized; returns the sampling params with max_tokens fitted.

    An explicit max_tokens that does not fit is an error; the default is shortened to the room left.
    """
    if not token_ids:
        raise invalid(prompt_param, f"{prompt_param} must not be empty")
    bad = next((t for t in token_ids if not 0 <= t < model.vocab_size), None)
    if bad is not None:
        raise invalid(ids_param, f"{ids_param} must be in [0, {model.vocab_size}), got {bad}")
    sampling = params.sampling
    bad = next((t for t, _ in sampling.logit_bias if t >= model.vocab_size), None)
    if bad is not None:
        raise invalid(bias_param, f"{bias_param} token ids must be in [0, {model.vocab_size}), got {bad}")
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


def effective_salt(cache_salt: str, identity: str) -> str:
    """The salt the workers hash with (DESIGN §3): the caller's salt bound to the caller's identity, so a salt
    alone never opens another tenant's prefixes. No salt = the shared public namespace."""
    if not cache_salt:
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
        min_tokens=s.min_tokens, prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None)
    opts = request.stream_options
    return GenerateParams(
        model=model.id, prompt_text=request.text if kind == "text" else None,
        prompt_ids=tuple(request.token_ids.ids) if kind == "token_ids" else None, sampling=sampling,
        max_tokens_explicit=s.HasField("max_tokens"), request_id=check_request_id(request.request_id),
        cache_salt=request.cache_salt, skip_text=opts.skip_text,
        include_prompt_token_ids=opts.include_prompt_token_ids, include_metrics=opts.include_metrics)


# -------------------------------------------------------------------------------------------------------- OpenAI

def _typed(body: Mapping[str, Any], key: str, types: tuple[type, ...], what: str, default: Any = None) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    # NOTE: bool is an int subclass in Python; JSON `true` is never a number here.
    if isinstance(value, bool) and bool not in types:
        raise invalid(key, f"{key} must be {what}, got {value!r}")
    if not isinstance(value, types):
        raise invalid(key, f"{key} must be {what}, got {value!r}")
    return value


def _number(body: Mapping[str, Any], key: str, default: float | None) -> float | None:
    value = _typed(body, key, (int, float), "a number", default)
    return None if value is None else float(value)


def _integer(body: Mapping[str, Any], key: str, default: int | None) -> int | None:
    return _typed(body, key, (int,), "an integer", default)


def _stop(body: Mapping[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or any(not isinstance(s, str) or not s for s in stop):
        raise invalid("stop", f"stop must be a non-empty string or a list of non-empty strings, got {stop!r}")
    return stop


def _unsupported(body: Mapping[str, Any]) -> None:
    """Reject options this server would otherwise silently ignore (an ignored option is a wrong answer)."""
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1):
        raise invalid("best_of", f"best_of must equal n (ranking extra candidates is not supported), got {best_of!r}")
    if body.get("tools") or body.get("functions"):
        raise invalid("tools", "tools / function calling are not supported; omit tools")
    fmt = body.get("response_format")
    if fmt not in (None, {}) and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise invalid("response_format", f"response_format must be {{'type': 'text'}}, got {fmt!r}")
    if body.get("suffix"):
        raise invalid("suffix", "suffix is not supported; omit it")


def _logit_bias(body: Mapping[str, Any]) -> dict[int, float]:
    """OpenAI's `{"<token id>": bias}` (JSON keys are strings)."""
    raw = _typed(body, "logit_bias", (dict,), "an object mapping token ids to numbers", {})
    bias = {}
    for key, value in raw.items():
        try:
            token_id = int(key)
        except (TypeError, ValueError):
            raise invalid("logit_bias", f"logit_bias keys must be token ids, got {key!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise invalid("logit_bias", f"logit_bias values must be numbers in [-100, 100], got {value!r}")
        bias[token_id] = float(value)
    return bias


def _prompt_logprobs(body: Mapping[str, Any], logprobs: int | None, chat: bool) -> int | None:
    """vLLM's `prompt_logprobs: N` on either door; on completions `echo` with `logprobs: N` asks for them too (the
    echoed prompt's tokens then carry logprobs, as OpenAI's legacy API did)."""
    value = _typed(body, "prompt_logprobs", (int,), f"an integer in [0, {MAX_LOGPROBS}]", None)
    if value is None and not chat and body.get("echo") and logprobs is not None:
        value = logprobs
    return value


def _completion_logprobs(body: Mapping[str, Any]) -> tuple[int | None, str]:
    """`/v1/completions`: `logprobs` is the number of alternatives per token (OpenAI allows up to 5, vLLM 20)."""
    if body.get("top_logprobs") is not None:
        raise invalid("top_logprobs", "top_logprobs is a chat option; /v1/completions takes logprobs: <int>")
    return _typed(body, "logprobs", (int,), f"an integer in [0, {MAX_LOGPROBS}]", None), "logprobs"


def _chat_logprobs(body: Mapping[str, Any]) -> tuple[int | None, str]:
    """`/v1/chat/completions`: `logprobs: true` returns the sampled tokens' logprobs, `top_logprobs: N` adds the N
    most likely alternatives (it needs logprobs: true)."""
    wanted = bool(_typed(body, "logprobs", (bool,), "a boolean", False))
    top = _typed(body, "top_logprobs", (int,), f"an integer in [0, {MAX_LOGPROBS}]", None)
    if top is not None and not wanted:
        raise invalid("top_logprobs", "top_logprobs needs logprobs: true")
    return ((top or 0) if wanted else None), ("top_logprobs" if top is not None else "logprobs")


def _openai_sampling(body: Mapping[str, Any], max_tokens_keys: Sequence[str],
                     defaults: Mapping[str, float], chat: bool) -> tuple[SamplingParams, bool]:
    max_tokens, explicit = None, False
    for key in max_tokens_keys:
        value = _integer(body, key, None)
        if value is not None:
            if value < 1:
                raise invalid(key, f"{key} must be >= 1, got {value}")
            max_tokens, explicit = value, True
            break
    logprobs, logprobs_param = (_chat_logprobs if chat else _completion_logprobs)(body)
    stop_token_ids = _typed(body, "stop_token_ids", (list,), "a list of token ids", [])
    if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in stop_token_ids):
        raise invalid("stop_token_ids", f"stop_token_ids must be non-negative integers, got {stop_token_ids!r}")
    sampling = build_sampling(
        "", max_tokens=max_tokens, temperature=_number(body, "temperature", defaults.get("temperature", 1.0)),
        top_p=_number(body, "top_p", defaults.get("top_p")),
        top_k=_integer(body, "top_k", int(defaults.get("top_k", 0))) if body.get("top_k") != -1 else 0,
        seed=_integer(body, "seed", None), stop=_stop(body), stop_token_ids=stop_token_ids,
        ignore_eos=bool(_typed(body, "ignore_eos", (bool,), "a boolean", False)),
        include_stop_str_in_output=bool(_typed(body, "include_stop_str_in_output", (bool,), "a boolean", False)),
        draw_seed=draw_seed,
        repetition_penalty=_number(body, "repetition_penalty", defaults.get("repetition_penalty")),
        presence_penalty=_number(body, "presence_penalty", 0.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0), logprobs=logprobs, logprobs_param=logprobs_param,
        logit_bias=_logit_bias(body), min_tokens=_integer(body, "min_tokens", 0),
        prompt_logprobs=_prompt_logprobs(body, logprobs, chat), prompt_logprobs_param=(
            "logprobs" if body.get("prompt_logprobs") is None else "prompt_logprobs"))
    return sampling, explicit


def _choices(body: Mapping[str, Any]) -> int:
    n = _typed(body, "n", (int,), f"an integer in [1, {MAX_CHOICES}]", 1)
    if not 1 <= n <= MAX_CHOICES:
        raise invalid("n", f"n must be in [1, {MAX_CHOICES}], got {n}")
    return n


def _stream_options(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = bool(_typed(body, "stream", (bool,), "a boolean", False))
    options = _typed(body, "stream_options", (dict,), "an object", {})
    if options and not stream:
        raise invalid("stream_options", "stream_options is only allowed with stream: true")
    return stream, bool(options.get("include_usage", False))


def _common(body: Mapping[str, Any], models: Mapping[str, ModelLimits], request_id: str,
            chat: bool) -> dict[str, Any]:
    if not isinstance(body, Mapping):
        raise invalid("body", "the request body must be a JSON object")
    model = _typed(body, "model", (str,), "a string", "")
    _unsupported(body)
    limits = resolve_model(model, models)
    sampling, explicit = _openai_sampling(body, ("max_tokens", "max_completion_tokens"),
                                          dict(limits.sampling_defaults), chat)
    return dict(model=limits.id, sampling=sampling, max_tokens_explicit=explicit,
                request_id=request_id, cache_salt=_typed(body, "cache_salt", (str,), "a string", ""))


def from_completion(body: Mapping[str, Any], models: Mapping[str, ModelLimits],
                    request_id: str) -> tuple[GenerateParams, OpenAIOptions]:
    """`POST /v1/completions`: prompt is a string, a list of token ids, or a one-element list of either."""
    common = _common(body, models, request_id, chat=False)
    prompt = body.get("prompt")
    batch = isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)
    prompts = [_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)] if batch else [_one_prompt(prompt)]
    if len(prompts) > MAX_BATCH_PROMPTS:
        raise invalid("prompt", f"prompt holds {len(prompts)} prompts; at most {MAX_BATCH_PROMPTS} per request")
    if len(prompts) * _choices(body) > MAX_BATCH_PROMPTS:
        raise invalid("n", f"{len(prompts)} prompts x n={_choices(body)} choices exceed {MAX_BATCH_PROMPTS}")
    stream, include_usage = _stream_options(body)
    echo = bool(_typed(body, "echo", (bool,), "a boolean", False))
    text, ids = prompts[0]
    return (GenerateParams(prompt_text=text, prompt_ids=ids, **common),
            OpenAIOptions(stream=stream, include_usage=include_usage, echo=echo, n=_choices(body),
                          prompts=tuple(prompts) if len(prompts) > 1 else ()))


def _one_prompt(prompt: Any, param: str = "prompt") -> tuple[str | None, tuple[int, ...] | None]:
    """A completion prompt: a non-empty string or a non-empty list of token ids."""
    if isinstance(prompt, str) and prompt:
        return prompt, None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None, tuple(prompt)
    raise invalid(param, f"{param} is required: a non-empty string or a non-empty list of token ids (or a list of "
                         f"those, a batch)")


def check_messages(body: Mapping[str, Any]) -> tuple[dict, ...]:
    """Chat messages as plain {role, content: str} dicts (content parts of type text are joined)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "messages is required: a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise invalid(f"messages[{i}]", f"messages[{i}] must be an object with role and content")
        role, content = m.get("role"), m.get("content")
        if role not in _CHAT_ROLES:
            raise invalid(f"messages[{i}].role", f"messages[{i}].role must be one of {_CHAT_ROLES}, got {role!r}")
        if isinstance(content, list):
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise invalid(f"messages[{i}].content", f"messages[{i}].content parts must be of type 'text'")
            content = "".join(str(p.get("text", "")) for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise invalid(f"messages[{i}].content", f"messages[{i}].content must be a string, got {content!r}")
        out.append({"role": role, "content": content})
    return tuple(out)


def from_chat(body: Mapping[str, Any], models: Mapping[str, ModelLimits], request_id: str,
              render: Callable[[Sequence[dict]], str]) -> tuple[GenerateParams, OpenAIOptions]:
    """`POST /v1/chat/completions`: `render` applies the model's chat template (or the plain fallback)."""
    common = _common(body, models, request_id, chat=True)
    messages = check_messages(body)
    stream, include_usage = _stream_options(body)
    text = render(messages)
    # NOTE: the template already wrote any special tokens; adding a BOS again would change the prompt.
    return (GenerateParams(prompt_text=text, prompt_ids=None, add_special_tokens=False, **common),
            OpenAIOptions(stream=stream, include_usage=include_usage, chat=True, messages=messages,
                          n=_choices(body)))


__all__ = ["ApiError", "GenerateParams", "ModelLimits", "OpenAIOptions", "build_sampling", "check_messages",
           "batch_params", "choice_params", "check_prompt", "effective_salt", "from_chat", "from_completion", "from_grpc", "invalid",
           "resolve_model", "DEFAULT_MAX_TOKENS"]
