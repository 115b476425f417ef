"""router.validation: every rejection names the field and the allowed range, with the status docs/api.md promises."""
from __future__ import annotations

import grpc
import pytest

from router.openai_request import batch_params, choice_params, from_chat, from_completion
from router.validation import ApiError, GenerateParams, ModelLimits, check_prompt, effective_salt, from_grpc
from strata.v1 import common_pb2, strata_pb2

MODELS = {"tiny": ModelLimits("tiny", max_model_len=64, vocab_size=100)}


def make_grpc(text: str | None = "hello", ids: list[int] | None = None, **sampling) -> strata_pb2.GenerateRequest:
    req = strata_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(**sampling))
    if ids is not None:
        req.token_ids.ids.extend(ids)
    elif text is not None:
        req.text = text
    return req


def grpc_error(req: strata_pb2.GenerateRequest) -> ApiError:
    with pytest.raises(ApiError) as info:
        from_grpc(req, MODELS)
    return info.value


def http_error(body: dict, chat: bool = False) -> ApiError:
    with pytest.raises(ApiError) as info:
        if chat:
            from_chat(body, MODELS, "r1", lambda msgs: "x")
        else:
            from_completion(body, MODELS, "r1")
    return info.value


@pytest.mark.parametrize("sampling, field, fragment", [
    ({"temperature": -1.0}, "sampling.temperature", "[0, 100]"),
    ({"max_tokens": 0}, "sampling.max_tokens", ">= 1, got 0"),
    ({"top_p": 2.0}, "sampling.top_p", "(0, 1], got 2.0"),
    ({"top_p": 0.0}, "sampling.top_p", "(0, 1], got 0.0"),
    ({"seed": 2**63}, "sampling.seed", "[0, 2**63)"),
    ({"stop": [""]}, "sampling.stop", "non-empty"),
    ({"logprobs": 21}, "sampling.logprobs", "[0, 20]"),
    ({"max_tokens": 3, "min_tokens": 4}, "sampling.min_tokens", "[0, max_tokens=3]"),
])
def test_grpc_sampling_out_of_range_is_invalid_argument_naming_the_field(sampling, field, fragment):
    err = grpc_error(make_grpc(**sampling))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.param == field
    assert err.message.startswith(field) and fragment in err.message


def test_grpc_missing_or_empty_prompt_is_invalid_argument():
    for req in (make_grpc(text=None), make_grpc(text=""), make_grpc(ids=[])):
        err = grpc_error(req)
        assert (err.code, err.param) == (grpc.StatusCode.INVALID_ARGUMENT, "prompt")


def test_grpc_unknown_model_is_not_found():
    req = make_grpc()
    req.model = "other"
    err = grpc_error(req)
    assert (err.code, err.param) == (grpc.StatusCode.NOT_FOUND, "model")
    assert "'other'" in err.message and "tiny" in err.message


def test_grpc_defaults_draw_a_seed_and_leave_max_tokens_unset():
    params = from_grpc(make_grpc(), MODELS)
    assert params.model == "tiny" and params.prompt_text == "hello"
    assert params.sampling.seed is not None and 0 <= params.sampling.seed < 2**63
    assert params.sampling.temperature == 0.0 and params.sampling.top_p == 1.0
    assert not params.max_tokens_explicit
    assert params.request_id  # assigned


def test_grpc_explicit_values_pass_through():
    params = from_grpc(make_grpc(ids=[1, 2, 3], max_tokens=5, temperature=0.5, top_p=0.9, top_k=7, seed=0,
                                 stop=["\n"]), MODELS)
    s = params.sampling
    assert params.prompt_ids == (1, 2, 3)
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.stop) == (5, 0.5, 0.9, 7, 0, ("\n",))
    assert params.max_tokens_explicit


def _params(max_tokens: int, explicit: bool) -> GenerateParams:
    from engine.sampling_params import SamplingParams
    return GenerateParams("tiny", "x", None, SamplingParams(max_tokens=max_tokens), explicit, "r")


def test_check_prompt_rejects_out_of_vocab_and_too_long():
    with pytest.raises(ApiError, match=r"prompt.token_ids must be in \[0, 100\), got 100"):
        check_prompt(_params(4, True), [1, 100], MODELS["tiny"])
    with pytest.raises(ApiError, match="60 tokens \\+ max_tokens 10 exceed max_model_len 64"):
        check_prompt(_params(10, True), [1] * 60, MODELS["tiny"])
    with pytest.raises(ApiError, match="leave no room"):
        check_prompt(_params(1, False), [1] * 64, MODELS["tiny"])


def test_check_prompt_shortens_the_default_max_tokens_to_the_room_left():
    assert check_prompt(_params(64, False), [1] * 60, MODELS["tiny"]).max_tokens == 4
    assert check_prompt(_params(3, True), [1] * 60, MODELS["tiny"]).max_tokens == 3


@pytest.mark.parametrize("body, field", [
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "top_p": 2}, "top_p"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "max_tokens": 1.5}, "max_tokens"),
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt[1]"),
    ({"prompt": ["a"] * 65}, "prompt"),
    ({"prompt": ["a"] * 8, "n": 9}, "n"),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"5": "up"}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": [5]}, "logit_bias"),
    ({"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"prompt": "hi", "min_tokens": -1}, "min_tokens"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "n": 17}, "n"),
    ({"prompt": "hi", "n": 2, "best_of": 3}, "best_of"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "logprobs": -1}, "logprobs"),
    ({"prompt": "hi", "logprobs": True}, "logprobs"),
    ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "hi", "logprobs": 21, "echo": True}, "logprobs"),
    ({"prompt": "hi", "top_logprobs": 2}, "top_logprobs"),
    ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "hi", "frequency_penalty": "x"}, "frequency_penalty"),
    ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_completion_bad_fields_are_rejected_naming_them(body, field):
    err = http_error({"model": "tiny", **body})
    assert (err.code, err.param) == (grpc.StatusCode.INVALID_ARGUMENT, field)
    assert field.split("[")[0] in err.message


def test_completion_unknown_model_is_not_found():
    err = http_error({"model": "gpt-4", "prompt": "hi"})
    assert (err.code, err.param) == (grpc.StatusCode.NOT_FOUND, "model")


def test_completion_accepts_openai_shapes():
    params, opts = from_completion({"model": "tiny", "prompt": ["hi"], "max_tokens": 3, "stream": True,
                                    "stream_options": {"include_usage": True}, "seed": 4, "stop": "x"}, MODELS, "r")
    assert params.prompt_text == "hi" and params.sampling.max_tokens == 3 and params.sampling.stop == ("x",)
    assert params.sampling.temperature == 1.0  # OpenAI's default
    penalized, _ = from_completion({"model": "tiny", "prompt": "hi", "presence_penalty": 0.5, "frequency_penalty": -1,
                                    "repetition_penalty": 1.2}, MODELS, "r")
    s = penalized.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -1.0, 1.2)
    assert opts.stream and opts.include_usage
    params, _ = from_completion({"prompt": [[5, 6]]}, MODELS, "r")  # model omitted: the only one served
    assert params.prompt_ids == (5, 6) and params.model == "tiny"


def test_chat_messages_are_checked_and_rendered():
    assert http_error({"model": "tiny"}, chat=True).param == "messages"
    assert http_error({"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, chat=True).param \
        == "messages[0].role"
    assert http_error({"model": "tiny", "messages": [{"role": "user", "content": 3}]}, chat=True).param \
        == "messages[0].content"
    seen = []
    params, opts = from_chat({"model": "tiny", "max_completion_tokens": 2,
                              "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
                             MODELS, "r", lambda msgs: seen.append(msgs) or "TEMPLATED")
    assert params.prompt_text == "TEMPLATED" and not params.add_special_tokens
    assert params.sampling.max_tokens == 2 and opts.chat
    assert seen == [({"role": "user", "content": "hi"},)]


def test_prompt_logprobs_from_echo_with_logprobs_or_vllms_option():
    echo, _ = from_completion({"model": "tiny", "prompt": "hi", "echo": True, "logprobs": 2}, MODELS, "r")
    assert (echo.sampling.logprobs, echo.sampling.prompt_logprobs) == (2, 2)
    plain, _ = from_completion({"model": "tiny", "prompt": "hi", "logprobs": 2}, MODELS, "r")
    assert plain.sampling.prompt_logprobs is None
    explicit, _ = from_completion({"model": "tiny", "prompt": "hi", "prompt_logprobs": 0}, MODELS, "r")
    assert (explicit.sampling.logprobs, explicit.sampling.prompt_logprobs) == (None, 0)
    assert from_grpc(make_grpc(prompt_logprobs=3), MODELS).sampling.prompt_logprobs == 3


def test_logprobs_options_of_each_door():
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    assert from_chat(chat, MODELS, "r", lambda m: "x")[0].sampling.logprobs is None
    assert from_chat({**chat, "logprobs": True}, MODELS, "r", lambda m: "x")[0].sampling.logprobs == 0
    assert from_chat({**chat, "logprobs": True, "top_logprobs": 4}, MODELS, "r",
                     lambda m: "x")[0].sampling.logprobs == 4
    assert http_error({**chat, "top_logprobs": 4}, chat=True).param == "top_logprobs"  # needs logprobs: true
    assert http_error({**chat, "logprobs": True, "top_logprobs": 21}, chat=True).param == "top_logprobs"
    assert http_error({**chat, "logprobs": 3}, chat=True).param == "logprobs"  # a boolean in chat
    assert from_completion({"model": "tiny", "prompt": "hi", "logprobs": 3}, MODELS, "r")[0].sampling.logprobs == 3
    assert from_completion({"model": "tiny", "prompt": "hi"}, MODELS, "r")[0].sampling.logprobs is None


def test_logit_bias_is_parsed_from_string_keys_and_its_ids_checked_against_the_vocabulary():
    params, _ = from_completion({"model": "tiny", "prompt": "hi", "logit_bias": {"5": 10, "2": -3.5}}, MODELS, "r")
    assert params.sampling.logit_bias == ((2, -3.5), (5, 10.0))
    vocab = MODELS["tiny"].vocab_size
    far, _ = from_completion({"model": "tiny", "prompt": "hi", "logit_bias": {str(vocab): 1}}, MODELS, "r")
    with pytest.raises(ApiError) as info:
        check_prompt(far, [1, 2], MODELS["tiny"], bias_param="logit_bias")
    assert info.value.param == "logit_bias" and f"[0, {vocab})" in info.value.message
    grpc_params = from_grpc(make_grpc(logit_bias={3: 2.0}), MODELS)
    assert grpc_params.sampling.logit_bias == ((3, 2.0),)
    assert grpc_error(make_grpc(logit_bias={3: 200.0})).param == "sampling.logit_bias"


def test_min_tokens_follows_a_max_tokens_shortened_to_the_context():
    params, _ = from_completion({"model": "tiny", "prompt": "hi", "min_tokens": 20}, MODELS, "r")
    room = MODELS["tiny"].max_model_len - 60
    sampling = check_prompt(params, [1] * 60, MODELS["tiny"])
    assert (sampling.max_tokens, sampling.min_tokens) == (room, min(20, room))


def test_a_batch_of_prompts_runs_prompt_by_prompt_then_choice_by_choice():
    params, opts = from_completion({"model": "tiny", "prompt": ["one", [5, 6], "three"], "n": 2, "seed": 7},
                                   MODELS, "r")
    runs = batch_params(params, opts)
    assert opts.num_choices == 6 and len(runs) == 6
    assert [(r.prompt_text, r.prompt_ids) for r in runs[::2]] == [("one", None), (None, (5, 6)), ("three", None)]
    assert [r.request_id for r in runs[:3]] == ["r-p0-0", "r-p0-1", "r-p1-0"]
    assert [r.sampling.seed for r in runs] == [7, 8] * 3
    single, opts = from_completion({"model": "tiny", "prompt": [[5, 6]]}, MODELS, "r")
    assert single.prompt_ids == (5, 6) and opts.prompts == () and batch_params(single, opts) == [single]


def test_n_choices_are_runs_with_consecutive_seeds_and_their_own_ids():
    params, opts = from_completion({"model": "tiny", "prompt": "hi", "n": 3, "seed": 2**63 - 2}, MODELS, "r")
    assert opts.n == 3
    runs = choice_params(params, opts.n)
    assert [r.request_id for r in runs] == ["r-0", "r-1", "r-2"]
    assert [r.sampling.seed for r in runs] == [2**63 - 2, 2**63 - 1, 0]
    assert choice_params(params, 1) == [params]
    drawn, _ = from_completion({"model": "tiny", "prompt": "hi", "n": 2}, MODELS, "r")
    assert drawn.sampling.seed is not None  # drawn once: the choices differ, a retry of one reproduces it


def test_effective_salt_binds_the_salt_to_the_caller():
    assert effective_salt("", "alice") == ""
    assert effective_salt("s", "alice") != effective_salt("s", "bob")
    assert effective_salt("s", "alice") == effective_salt("s", "alice")


def test_openai_door_takes_the_models_generation_config_defaults_under_explicit_options():
    models = {"m": ModelLimits("m", 64, 100, (("temperature", 0.3), ("top_p", 0.9), ("repetition_penalty", 1.3)))}
    plain, _ = from_completion({"model": "m", "prompt": "hi"}, models, "r")
    s = plain.sampling
    assert (s.temperature, s.top_p, s.repetition_penalty) == (0.3, 0.9, 1.3)
    explicit, _ = from_completion({"model": "m", "prompt": "hi", "temperature": 0, "top_p": 1,
                                   "repetition_penalty": 1}, models, "r")
    s = explicit.sampling
    assert (s.temperature, s.top_p, s.repetition_penalty) == (0.0, 1.0, 1.0)


def test_generation_config_sampling_defaults_are_read_like_the_engine():
    from router.served_model import sampling_defaults

    assert sampling_defaults({"do_sample": True, "temperature": 0.3, "top_p": 0.9, "max_new_tokens": 9}) == (
        ("temperature", 0.3), ("top_p", 0.9))
    assert sampling_defaults({"do_sample": False, "temperature": 0.7, "repetition_penalty": 1.1}) == (
        ("repetition_penalty", 1.1),)
    assert sampling_defaults({}) == ()


@pytest.mark.parametrize("body, chat, field", [
    ({"prompt": "hi", "temprature": 0.5}, False, "temprature"),          # a misspelt option is refused, not ignored
    ({"prompt": "hi", "max_token": 5, "zeta": 1}, False, "max_token"),  # several: the first named, all listed
    ({"messages": [{"role": "user", "content": "hi"}], "echo": True}, True, "echo"),   # a completions-only field
])
def test_unknown_request_fields_are_400_naming_them(body, chat, field):
    err = http_error({"model": "tiny", **body}, chat=chat)
    assert (err.code, err.param) == (grpc.StatusCode.INVALID_ARGUMENT, field)
    assert "unrecognized request field" in err.message and repr(field) in err.message


def test_openai_metadata_fields_that_change_no_output_are_accepted():
    params, _ = from_completion({"model": "tiny", "prompt": "hi", "user": "u1", "metadata": {"k": "v"},
                                 "store": False, "service_tier": "auto"}, MODELS, "r")
    assert params.prompt_text == "hi"


@pytest.mark.parametrize("body, chat, field", [
    ({"prompt": "abc\ud800def"}, False, "prompt"),
    ({"prompt": ["ok", "x\udfffy"]}, False, "prompt[1]"),
    ({"prompt": "hi", "stop": ["\ud83d"]}, False, "stop[0]"),
    ({"messages": [{"role": "user", "content": "a\ud800"}]}, True, "messages[0].content"),
])
def test_a_lone_surrogate_anywhere_is_400_naming_where(body, chat, field):
    err = http_error({"model": "tiny", **body}, chat=chat)
    assert (err.code, err.param) == (grpc.StatusCode.INVALID_ARGUMENT, field)
    assert "not valid UTF-8" in err.message


def test_check_prompt_rejects_stop_token_ids_outside_the_vocabulary():
    from dataclasses import replace
    params = _params(4, True)
    params = replace(params, sampling=replace(params.sampling, stop_token_ids=(3, 100)))
    with pytest.raises(ApiError, match=r"sampling.stop_token_ids must be in \[0, 100\), got 100") as info:
        check_prompt(params, [1, 2], MODELS["tiny"], stop_ids_param="sampling.stop_token_ids")
    assert info.value.param == "sampling.stop_token_ids"
