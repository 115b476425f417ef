"""What the OpenAI-compatible API answers: error bodies, whole responses, stream chunks and their logprobs objects,
for `text_completion` and `chat.completion` with n choices per prompt (`router.openai_api` serves them)."""
from __future__ import annotations

import math
import time
from typing import Any, NamedTuple

import grpc
from fastapi.responses import JSONResponse

from router.openai_request import OpenAIOptions
from router.validation import ApiError, GenerateParams
from strata.v1 import common_pb2

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.ALREADY_EXISTS: 409, grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504, grpc.StatusCode.CANCELLED: 499,
}
FINISH_REASONS = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
           common_pb2.FINISH_REASON_ABORT: "abort"}

def error_body(exc: ApiError) -> dict[str, Any]:
    kind = "invalid_request_error" if exc.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                                                   grpc.StatusCode.UNAUTHENTICATED) else exc.code.name.lower()
    code = "model_not_found" if exc.code == grpc.StatusCode.NOT_FOUND and exc.param == "model" else None
    if exc.code == grpc.StatusCode.UNAUTHENTICATED:
        code = "invalid_api_key"  # as OpenAI answers a missing or wrong key
    return {"error": {"message": _encodable(exc.message), "type": kind, "param": _encodable(exc.param),
                      "code": code}}


def _encodable(text: str | None) -> str | None:
    """NOTE: a message or param may quote a client's lone surrogate ("\\ud800" in its JSON), which UTF-8 cannot
    encode: escaped, so the error body itself never fails (a 500 in place of the 400)."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(exc: ApiError) -> JSONResponse:
    headers = None if exc.retry_after_s is None else {"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))}
    return JSONResponse(error_body(exc), status_code=HTTP_STATUS.get(exc.code, 500), headers=headers)


def _usage(usage: common_pb2.Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


class _Logprobs:
    """OpenAI's logprobs objects from the stream's `TokenLogprobs`; a token's text is its id decoded alone (as vLLM
    reports it). Chat: `{"content": [{token, logprob, bytes, top_logprobs: [...]}]}`; completions: the legacy
    `{tokens, token_logprobs, top_logprobs: [{text: logprob}], text_offset}` (the sampled token is in its dict)."""

    def __init__(self, tokenizer, chat: bool) -> None:
        self.tokenizer, self.chat = tokenizer, chat
        self._texts: dict[int, str] = {}
        self._offset = 0  # text_offset of the next completion token

    def _text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _entry(self, lp: common_pb2.Logprob) -> dict[str, Any]:
        text = self._text(lp.token_id)
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}

    def prompt(self, first_token_id: int, entries) -> dict[str, Any]:
        """The echoed prompt's part of a completion's legacy logprobs: its first token has none (null)."""
        part = self.format(entries)
        text = self._text(first_token_id)
        part["tokens"].insert(0, text)
        part["token_logprobs"].insert(0, None)
        part["top_logprobs"].insert(0, None)
        part["text_offset"] = [0] + [o + len(text) for o in part["text_offset"]]
        self._offset += len(text)
        return part

    def vllm_prompt(self, first_token_id: int, entries) -> list[dict[str, Any] | None]:
        """vLLM's `prompt_logprobs`: per prompt token, null for the first, else {token id: {logprob, rank,
        decoded_token}} over the token itself and the most likely ones."""
        out: list[dict[str, Any] | None] = [None]
        for e in entries:
            ranked = {str(t.token_id): {"logprob": t.logprob, "rank": r, "decoded_token": self._text(t.token_id)}
                      for r, t in enumerate(e.top, start=1)}
            ranked[str(e.sampled.token_id)] = {"logprob": e.sampled.logprob, "rank": e.rank,
                                               "decoded_token": self._text(e.sampled.token_id)}
            out.append(ranked)
        return out

    def format(self, entries) -> dict[str, Any]:
        if self.chat:
            return {"content": [dict(self._entry(e.sampled), top_logprobs=[self._entry(t) for t in e.top])
                                for e in entries], "refusal": None}
        tokens = [self._text(e.sampled.token_id) for e in entries]
        offsets = []
        for text in tokens:
            offsets.append(self._offset)
            self._offset += len(text)
        return {"tokens": tokens, "token_logprobs": [e.sampled.logprob for e in entries],
                "top_logprobs": [{**{self._text(t.token_id): t.logprob for t in e.top},
                                  self._text(e.sampled.token_id): e.sampled.logprob} for e in entries],
                "text_offset": offsets}


class Choice(NamedTuple):
    text: str
    finish: str | None
    logprobs: list          # common_pb2.TokenLogprobs
    prompt_logprobs: list   # common_pb2.TokenLogprobs of prompt tokens 1.., when asked for


class Shape:
    """The JSON shapes of one endpoint (`text_completion` or `chat.completion`) for its `n` choices."""

    def __init__(self, params: GenerateParams, options: OpenAIOptions, tokenizer=None) -> None:
        self.chat, self.options = options.chat, options
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + params.request_id
        self.model, self.created = params.model, int(time.time())
        wanted = params.sampling.logprobs is not None or params.sampling.prompt_logprobs is not None
        self.logprobs = [_Logprobs(tokenizer, self.chat) if wanted else None for _ in range(options.num_choices)]
        self.sampled = params.sampling.logprobs is not None
        self.echo_logprobs = options.echo and self.sampled and not self.chat
        self.prompt_wanted = params.sampling.prompt_logprobs is not None

    def _logprobs(self, index: int, entries, prompt: tuple[int, Any] | None = None) -> dict[str, Any] | None:
        """Choice `index`'s logprobs object for these entries; `prompt` = (first prompt token id, prompt entries)
        puts the echoed prompt's tokens first."""
        formatter = self.logprobs[index]
        if formatter is None or not self.sampled:
            return None
        if prompt is None or not self.echo_logprobs:
            return formatter.format(entries)
        part, rest = formatter.prompt(*prompt), formatter.format(entries)
        return {key: part[key] + rest[key] for key in part}

    def _prompt_logprobs(self, index: int, prompt: tuple[int, Any] | None) -> dict[str, Any]:
        """vLLM's `prompt_logprobs` field of a choice, where they were asked for."""
        if prompt is None or self.logprobs[index] is None or not self.prompt_wanted:
            return {}
        return {"prompt_logprobs": self.logprobs[index].vllm_prompt(*prompt)}

    def _envelope(self, obj: str, choices: list) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def whole(self, choices: list[Choice], usage: common_pb2.Usage, first_token_ids: list[int]) -> dict[str, Any]:
        """`first_token_ids[i]`: the first prompt token of choice i's prompt."""
        out = []
        for i, c in enumerate(choices):
            wanted = c.prompt_logprobs or self.echo_logprobs
            prompt = (first_token_ids[i], c.prompt_logprobs) if wanted else None
            if self.chat:
                choice = {"index": i, "message": {"role": "assistant", "content": c.text}}
            else:
                choice = {"index": i, "text": c.text}
            choice.update(finish_reason=c.finish, logprobs=self._logprobs(i, c.logprobs, prompt),
                          **self._prompt_logprobs(i, prompt))
            out.append(choice)
        body = self._envelope("chat.completion" if self.chat else "text_completion", out)
        body["usage"] = _usage(usage)
        return body

    def delta(self, index: int, text: str | None, finish: str | None, first: bool = False, logprobs=(),
              prompt: tuple[int, Any] | None = None) -> dict[str, Any]:
        """One chunk of choice `index`; `prompt` = (first prompt token id, prompt entries) on the echo chunk."""
        lp = self._logprobs(index, logprobs, prompt) if logprobs or (prompt and self.echo_logprobs) else None
        extra = self._prompt_logprobs(index, prompt)
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": lp, **extra}
            return self._envelope("chat.completion.chunk", [choice])
        return self._envelope("text_completion", [{"index": index, "text": text or "", "finish_reason": finish,
                                                   "logprobs": lp, **extra}])

    def usage_chunk(self, usage: common_pb2.Usage) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = _usage(usage)
        return body


def merged_usage(usages: dict[int, common_pb2.Usage], n: int) -> common_pb2.Usage:
    """Usage of the runs by choice index (prompt * n + i): each prompt counted once, every choice's completion."""
    prompts = [u for index, u in usages.items() if index % n == 0]
    return common_pb2.Usage(prompt_tokens=sum(u.prompt_tokens for u in prompts),
                            cached_tokens=sum(u.cached_tokens for u in prompts),
                            completion_tokens=sum(u.completion_tokens for u in usages.values()))
