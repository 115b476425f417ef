"""OpenAI request bodies (`/v1/completions`, `/v1/chat/completions`) to validated `GenerateParams` plus what the
HTTP layer needs (`OpenAIOptions`); every rejection an `ApiError` naming the field in the body's own spelling
(`top_p`, `messages[0].role`), as `router.validation` does for gRPC."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

from engine.sampling_params import MAX_LOGPROBS, SPECULATIVE_CHOICES, SamplingParams
from router.validation import (MAX_SEED, GenerateParams, ModelLimits, build_sampling, check_cache_salt, draw_seed,
                               invalid, resolve_model)

MAX_CHOICES = 16             # OpenAI's n
# Every field a request may carry: OpenAI's (some only to be refused by name, e.g. tools, or accepted as metadata
# that changes no output: user, metadata, store, service_tier) and vLLM's sampling extras. Anything else is a 400
# naming it, as OpenAI answers: a misspelt option silently ignored is a wrong answer.
_COMMON_FIELDS = frozenset({
    "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options",
    "stop", "stop_token_ids", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
    "logprobs", "min_tokens", "ignore_eos", "include_stop_str_in_output", "prompt_logprobs", "cache_salt",
    "speculative", "best_of", "response_format", "tools", "functions", "suffix", "user", "metadata", "store",
    "service_tier"})
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo"}
CHAT_FIELDS = _COMMON_FIELDS | {"messages", "top_logprobs", "tool_choice", "parallel_tool_calls", "function_call"}
MAX_BATCH_PROMPTS = 64       # completion prompts x choices in one request
_CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_JSON_DEPTH = 32          # arrays / objects inside each other; a real body nests 4 deep (content parts)
_SHOWN_CHARS = 120           # of a refused value, in the error message


def parse_body(raw: bytes) -> Any:
    """A request body as JSON (RFC 8259: UTF-8); anything else, or a nest deeper than MAX_JSON_DEPTH, is a 400
    naming `body`. NaN / Infinity literals parse (Python's json does) and fail the range checks by name."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid("body", f"the request body is not UTF-8 text (byte {exc.start}); send JSON in UTF-8") from None
    try:
        body = json.loads(text or "null")
    except RecursionError:
        raise invalid("body", f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # JSONDecodeError, or an integer of more digits than Python converts
        raise invalid("body", f"the request body is not valid JSON: {exc}") from None
    if _depth(body) > MAX_JSON_DEPTH:
        raise invalid("body", f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
    return body


def _depth(value: Any) -> int:
    """How deep lists and objects nest (iterative: the body may be as deep as the JSON parser allowed)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            todo.extend((child, depth + 1) for child in children)
    return deepest


def _show(value: Any) -> str:
    """A refused value as the error message quotes it: its repr, cut short (it may be megabytes)."""
    shown = repr(value)
    return shown if len(shown) <= _SHOWN_CHARS else f"{shown[:_SHOWN_CHARS]}... ({len(shown)} characters)"


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


def _typed(body: Mapping[str, Any], key: str, types: tuple[type, ...], what: str, default: Any = None) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    # NOTE: bool is an int subclass in Python; JSON `true` is never a number here.
    if isinstance(value, bool) and bool not in types:
        raise invalid(key, f"{key} must be {what}, got {value!r}")
    if not isinstance(value, types):
        raise invalid(key, f"{key} must be {what}, got {_show(value)}")
    return value


def _number(body: Mapping[str, Any], key: str, default: float | None) -> float | None:
    value = _typed(body, key, (int, float), "a number", default)
    return None if value is None else _float(value, key)


def _float(value: int | float, param: str) -> float:
    """A JSON number as a float; an integer past float's range (1e308) is out of every option's range."""
    try:
        return float(value)
    except OverflowError:
        raise invalid(param, f"{param} is out of range: an integer of {len(str(abs(value)))} digits") from None


def _integer(body: Mapping[str, Any], key: str, default: int | None) -> int | None:
    return _typed(body, key, (int,), "an integer", default)


def _stop(body: Mapping[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or any(not isinstance(s, str) or not s for s in stop):
        raise invalid("stop", f"stop must be a non-empty string or a list of non-empty strings, got {_show(stop)}")
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
    _metadata(body)


def _metadata(body: Mapping[str, Any]) -> None:
    """Options accepted as metadata that changes no output; still the types OpenAI documents."""
    for key in ("user", "service_tier"):
        _typed(body, key, (str,), "a string")
    _typed(body, "store", (bool,), "a boolean")
    metadata = _typed(body, "metadata", (dict,), "an object of string values", {})
    bad = next((k for k, v in metadata.items() if not isinstance(v, str)), None)
    if bad is not None:
        raise invalid(f"metadata.{bad}", f"metadata.{bad} must be a string (metadata values are), got "
                                         f"{_show(metadata[bad])}")


def _known_fields(body: Mapping[str, Any], known: frozenset[str], endpoint: str) -> None:
    # NOTE: a key may hold a lone surrogate ("\\ud800" in the JSON): named escaped, so the answer still encodes
    unknown = sorted(str(k).encode("utf-8", "backslashreplace").decode() for k in body if k not in known)
    if unknown:
        names = ", ".join(f"'{k}'" for k in unknown)
        raise invalid(unknown[0], f"unrecognized request field{'s' if len(unknown) > 1 else ''} {names}: not an "
                                  f"option of {endpoint} (check the spelling)")


def _valid_text(value: Any, path: str) -> None:
    """Every string of the body (keys too) must be encodable as UTF-8: JSON's escapes can spell a lone surrogate
    (`"\\ud800"`), which no tokenizer takes."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            where = path or "body"
            raise invalid(where, f"{where} is not valid UTF-8 text: it holds a lone surrogate at character "
                                 f"{exc.start}") from None
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _valid_text(key, path or "body")
            _valid_text(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _valid_text(item, f"{path}[{i}]")


def _logit_bias(body: Mapping[str, Any]) -> dict[int, float]:
    """OpenAI's `{"<token id>": bias}` (JSON keys are strings)."""
    raw = _typed(body, "logit_bias", (dict,), "an object mapping token ids to numbers", {})
    bias = {}
    for key, value in raw.items():
        try:
            token_id = int(key)
        except (TypeError, ValueError):
            raise invalid("logit_bias", f"logit_bias keys must be token ids, got {_show(key)}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise invalid("logit_bias", f"logit_bias values must be numbers in [-100, 100], got {_show(value)}")
        bias[token_id] = _float(value, "logit_bias")
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


def _openai_sampling(body: Mapping[str, Any], max_tokens_keys: Sequence[str], defaults: Mapping[str, float],
                     chat: bool, max_model_len: int) -> tuple[SamplingParams, bool]:
    max_tokens, explicit = None, False
    for key in max_tokens_keys:  # each is checked; the first one given is used
        value = _integer(body, key, None)
        if value is not None:
            if not 1 <= value < max_model_len:
                raise invalid(key, f"{key} must be in [1, {max_model_len - 1}] (below the model's max_model_len "
                                   f"{max_model_len}), got {value}")
            if not explicit:
                max_tokens, explicit = value, True
    logprobs, logprobs_param = (_chat_logprobs if chat else _completion_logprobs)(body)
    stop_token_ids = _typed(body, "stop_token_ids", (list,), "a list of token ids", [])
    if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in stop_token_ids):
        raise invalid("stop_token_ids", f"stop_token_ids must be non-negative integers, got {_show(stop_token_ids)}")
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
            "logprobs" if body.get("prompt_logprobs") is None else "prompt_logprobs"),
        speculative=_typed(body, "speculative", (str,), f"one of {', '.join(SPECULATIVE_CHOICES)}", None))
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
    unknown = next((str(k) for k in options if k != "include_usage"), None)
    if unknown is not None:
        raise invalid("stream_options", f"stream_options takes include_usage only, got {_show(unknown)}")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise invalid("stream_options.include_usage", f"stream_options.include_usage must be a boolean, got "
                                                      f"{_show(include_usage)}")
    return stream, include_usage


def _common(body: Mapping[str, Any], models: Mapping[str, ModelLimits], request_id: str,
            chat: bool) -> dict[str, Any]:
    if not isinstance(body, Mapping):
        raise invalid("body", "the request body must be a JSON object")
    _known_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS, "/v1/chat/completions" if chat else
                  "/v1/completions")
    _valid_text(body, "")
    model = _typed(body, "model", (str,), "a string", "")
    _unsupported(body)
    limits = resolve_model(model, models)
    sampling, explicit = _openai_sampling(body, ("max_tokens", "max_completion_tokens"),
                                          dict(limits.sampling_defaults), chat, limits.max_model_len)
    return dict(model=limits.id, sampling=sampling, max_tokens_explicit=explicit,
                request_id=request_id, cache_salt=check_cache_salt(_typed(body, "cache_salt", (str,), "a string", "")))


def from_completion(body: Mapping[str, Any], models: Mapping[str, ModelLimits],
                    request_id: str) -> tuple[GenerateParams, OpenAIOptions]:
    """`POST /v1/completions`: prompt is a string, a list of token ids, or a one-element list of either."""
    common = _common(body, models, request_id, chat=False)
    prompt = body.get("prompt")
    batch = isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)
    prompts = [_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)] if batch else [_one_prompt(prompt)]
    if len(prompts) > MAX_BATCH_PROMPTS:
        raise invalid("prompt", f"prompt holds {len(prompts)} prompts; at most {MAX_BATCH_PROMPTS} per request")
    n = _choices(body)
    if len(prompts) * n > MAX_BATCH_PROMPTS:
        raise invalid("n", f"{len(prompts)} prompts x n={n} choices exceed {MAX_BATCH_PROMPTS}")
    stream, include_usage = _stream_options(body)
    echo = bool(_typed(body, "echo", (bool,), "a boolean", False))
    text, ids = prompts[0]
    return (GenerateParams(prompt_text=text, prompt_ids=ids, **common),
            OpenAIOptions(stream=stream, include_usage=include_usage, echo=echo, n=n,
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
            raise invalid(f"messages[{i}].role", f"messages[{i}].role must be one of {_CHAT_ROLES}, got "
                                                 f"{_show(role)}")
        if isinstance(content, list):
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise invalid(f"messages[{i}].content", f"messages[{i}].content parts must be of type 'text'")
            bad = next((j for j, p in enumerate(content) if not isinstance(p.get("text", ""), str)), None)
            if bad is not None:
                raise invalid(f"messages[{i}].content[{bad}].text", f"messages[{i}].content[{bad}].text must be a "
                                                                    f"string")
            content = "".join(p.get("text", "") for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise invalid(f"messages[{i}].content", f"messages[{i}].content must be a string, got {_show(content)}")
        out.append({"role": role, "content": content})
    return tuple(out)


def from_chat(body: Mapping[str, Any], models: Mapping[str, ModelLimits], request_id: str,
              render: Callable[[Sequence[dict]], str]) -> tuple[GenerateParams, OpenAIOptions]:
    """`POST /v1/chat/completions`: `render` applies the model's chat template (or the plain fallback)."""
    common = _common(body, models, request_id, chat=True)
    messages = check_messages(body)
    stream, include_usage = _stream_options(body)
    try:
        text = render(messages)
    except ValueError as exc:  # ChatTemplateError: e.g. the template's raise_exception("roles must alternate")
        raise invalid("messages", f"the model's chat template refuses these messages: {exc}") from None
    # NOTE: the template already wrote any special tokens; adding a BOS again would change the prompt.
    return (GenerateParams(prompt_text=text, prompt_ids=None, add_special_tokens=False, **common),
            OpenAIOptions(stream=stream, include_usage=include_usage, chat=True, messages=messages,
                          n=_choices(body)))
