"""Regression examples from the hostile-request fuzz (tests/faults/test_hostile_requests.py): each was a 500, a crash,
a silently accepted bad value or an error that named no field before its fix."""
from __future__ import annotations

import asyncio
import json
from concurrent import futures

import grpc
import httpx
import pytest

from router.body_limit import BodyLimit
from router.grpc_decode import DecodeErrors
from router.openai_request import MAX_JSON_DEPTH, from_chat, from_completion, parse_body
from router.openai_responses import error_response
from router.validation import (MAX_CACHE_SALT_LEN, MAX_LOGIT_BIAS, MAX_STOP_CHARS, MAX_STOP_STRINGS,
                               MAX_STOP_TOKEN_IDS, ApiError, ModelLimits, from_grpc)
from strata.v1 import common_pb2, strata_pb2, strata_pb2_grpc

MODELS = {"tiny": ModelLimits("tiny", max_model_len=64, vocab_size=100)}


def http_error(body, chat: bool = False, render=lambda messages: "x") -> ApiError:
    with pytest.raises(ApiError) as info:
        if chat:
            from_chat(body, MODELS, "r1", render)
        else:
            from_completion(body, MODELS, "r1")
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return info.value


def completion(**fields) -> dict:
    return {"prompt": "hi", "max_tokens": 2, **fields}


def chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


# ------------------------------------------------------------------------------------------------ the body

@pytest.mark.parametrize("raw, fragment", [
    ('{"prompt": "hi"}'.encode("utf-16"), "not UTF-8"),
    (b"[" * 100_000, f"deeper than {MAX_JSON_DEPTH}"),
    (b'{"metadata": ' + b"[" * 40 + b"]" * 40 + b"}", f"deeper than {MAX_JSON_DEPTH}"),
    (b'{"max_tokens": ' + b"9" * 5000 + b"}", "not valid JSON"),
    (b"prompt=hi&max_tokens=2", "not valid JSON"),
])
def test_body_that_is_not_json_within_limits_is_400_naming_body(raw, fragment):
    """Were a 500: RecursionError / ValueError (integer digits) escaped the parser; UTF-16 was taken as JSON."""
    with pytest.raises(ApiError) as info:
        parse_body(raw)
    assert info.value.param == "body" and fragment in info.value.message


def test_nan_and_infinity_literals_parse_and_fail_the_range_check_by_name():
    body = parse_body(b'{"prompt": "hi", "temperature": NaN}')
    assert http_error(body).param == "temperature"
    assert http_error(parse_body(b'{"prompt": "hi", "top_p": -Infinity}')).param == "top_p"


@pytest.mark.parametrize("fields, param", [
    ({"temperature": 10**400}, "temperature"),
    ({"presence_penalty": -(10**400)}, "presence_penalty"),
    ({"logit_bias": {"1": 10**400}}, "logit_bias"),
])
def test_integer_past_float_range_is_400_naming_the_field(fields, param):
    """Were a 500: OverflowError converting the integer to a float."""
    err = http_error(completion(**fields))
    assert err.param == param and ("out of range" in err.message or "[-100, 100]" in err.message)


def test_unknown_field_with_a_lone_surrogate_renders_a_400():
    """Was a 500: the error body quoted the key, which UTF-8 cannot encode."""
    err = http_error(completion(**{"a\ud800b": 1}))
    response = error_response(err)
    assert response.status_code == 400
    error = json.loads(response.body)["error"]
    assert error["param"] == "a\\ud800b" and "'a\\ud800b'" in error["message"]


def test_error_body_escapes_any_lone_surrogate():
    response = error_response(ApiError(grpc.StatusCode.INVALID_ARGUMENT, "bad \udcff here", "stop[\ud800]"))
    assert json.loads(response.body)["error"] == {"message": "bad \\udcff here", "type": "invalid_request_error",
                                                  "param": "stop[\\ud800]", "code": None}


# ------------------------------------------------------------------------------------------------ ranges

@pytest.mark.parametrize("fields, param", [
    ({"top_k": 2**40}, "top_k"),                                   # was INTERNAL: past uint32 on the wire
    ({"max_tokens": 64}, "max_tokens"),                            # the model's whole length: names max_tokens
    ({"max_tokens": 10**30}, "max_tokens"),
    ({"max_tokens": 2, "max_completion_tokens": -1}, "max_completion_tokens"),   # was silently ignored
    ({"stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ({"stop": ["s" * (MAX_STOP_CHARS + 1)]}, "stop"),
    ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
    ({"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
    ({"cache_salt": "s" * (MAX_CACHE_SALT_LEN + 1)}, "cache_salt"),
    ({"stream": True, "stream_options": {"bogus": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"user": 5}, "user"),
    ({"store": "yes"}, "store"),
    ({"service_tier": [None]}, "service_tier"),
    ({"metadata": {"k": 1}}, "metadata.k"),
])
def test_out_of_range_or_silently_ignored_option_is_400_naming_it(fields, param):
    err = http_error(completion(**fields))
    assert err.param == param and param in err.message


@pytest.mark.parametrize("sampling, param", [
    ({"max_tokens": 64}, "sampling.max_tokens"),
    ({"stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "sampling.stop"),
    ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "sampling.stop_token_ids"),
])
def test_grpc_bounds_name_the_field(sampling, param):
    req = strata_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(**sampling))
    with pytest.raises(ApiError) as info:
        from_grpc(req, MODELS)
    assert (info.value.code, info.value.param) == (grpc.StatusCode.INVALID_ARGUMENT, param)


def test_grpc_overlong_cache_salt_names_it():
    req = strata_pb2.GenerateRequest(text="hi", cache_salt="s" * (MAX_CACHE_SALT_LEN + 1))
    with pytest.raises(ApiError) as info:
        from_grpc(req, MODELS)
    assert info.value.param == "cache_salt"


# ------------------------------------------------------------------------------------------------ chat

def test_content_part_text_that_is_not_a_string_names_the_part():
    """Was accepted: the number was turned into text."""
    body = chat(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}])
    assert http_error(body, chat=True).param == "messages[0].content[0].text"


def test_chat_template_refusal_is_400_naming_messages():
    """Was a 500: a template's raise_exception ("roles must alternate") escaped as ChatTemplateError."""
    def render(messages):
        raise ValueError("the chat template failed: Conversation roles must alternate user/assistant")
    err = http_error(chat(), chat=True, render=render)
    assert err.param == "messages" and "alternate" in err.message


# ------------------------------------------------------------------------------------------------ gRPC decoding

class _Echo(strata_pb2_grpc.StrataServicer):
    def Generate(self, request, context):
        yield strata_pb2.GenerateResponse(request_id=request.text)


@pytest.fixture(scope="module")
def generate():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), interceptors=[DecodeErrors()])
    strata_pb2_grpc.add_StrataServicer_to_server(_Echo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield channel.unary_stream("/strata.v1.Strata/Generate", request_serializer=lambda raw: raw,
                               response_deserializer=strata_pb2.GenerateResponse.FromString)
    channel.close()
    server.stop(0)


@pytest.mark.parametrize("payload, start", [
    (b"\xff\xff\xff", "request: not a serialized strata.v1.GenerateRequest"),
    (b"\x12\x01\xff", "text: not valid UTF-8"),                                 # text = b"\xff"
    (b"\x22\x03\x32\x01\xff", "sampling.stop: not valid UTF-8"),                # sampling.stop[0] = b"\xff"
])
def test_request_that_does_not_decode_is_invalid_argument_naming_the_field(generate, payload, start):
    """Was INTERNAL "Exception deserializing request!" (grpc-python's answer to a deserializer that raises)."""
    with pytest.raises(grpc.RpcError) as info:
        list(generate(payload, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(start)


def test_request_that_decodes_reaches_the_method(generate):
    chunks = list(generate(strata_pb2.GenerateRequest(text="hi").SerializeToString(), timeout=10))
    assert [c.request_id for c in chunks] == ["hi"]


# ------------------------------------------------------------------------------------------------ body size

async def _echo_size(scope, receive, send):
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": str(len(body)).encode()})


def _post(content, limit: int = 100) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=BodyLimit(_echo_size, limit))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            return await client.post("/v1/completions", content=content)
    return asyncio.run(go())


def test_body_over_the_limit_is_413_naming_the_limit():
    response = _post(b"x" * 101)
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["param"] == "body" and "at most 100 bytes" in error["message"]


def test_body_within_the_limit_reaches_the_app_whole():
    assert _post(b"x" * 100).text == "100"


def test_body_limit_zero_is_no_limit():
    assert _post(b"x" * 1000, limit=0).text == "1000"


# ------------------------------------------------------------------------------------------------ sampler numerics

def test_tiny_temperature_is_greedy_and_tiny_top_p_keeps_the_top_token():
    """Was a 500 (the engine step failed: "index -1 is out of bounds"): 2.2e-313 is 0 in the sampler's float32."""
    params, _ = from_completion(completion(temperature=2.2250738585e-313, top_p=1e-300), MODELS, "r1")
    assert (params.sampling.temperature, params.sampling.top_p) == (0.0, 1e-8)
    params, _ = from_completion(completion(temperature=1e-3, top_p=0.5), MODELS, "r1")
    assert (params.sampling.temperature, params.sampling.top_p) == (1e-3, 0.5)


def test_worker_applies_the_same_floors_to_direct_calls():
    from worker_common.convert import sampling_from_proto
    params = sampling_from_proto(common_pb2.SamplingParams(max_tokens=2, temperature=1e-300, top_p=1e-300))
    assert (params.temperature, params.top_p) == (0.0, 1e-8)


def test_repetition_penalty_below_the_floor_names_it():
    """1e-300 passed the old (0, 10] check and failed the engine step (a seen token's logit overflowed float32)."""
    err = http_error(completion(repetition_penalty=1e-300))
    assert err.param == "repetition_penalty" and "[0.01, 10]" in err.message
