"""Hypothesis strategies for hostile requests against both front doors (tests/faults/test_hostile_requests.py).

Every generated request says which fields it broke (`bad`): empty = a valid request (kept cheap: max_tokens <= 4,
at most 3 prompts x 2 choices), else the server must refuse it with a 4xx / client-error status that names one of
them. Values are drawn per field from the real field sets (`router.openai_request`, strata.proto): a field is left
out, given a valid value, or given a hostile one (wrong type, out of range, NaN / Infinity, lone surrogate,
overlong, nested); unknown fields, non-object and non-JSON bodies and raw garbage protobuf bytes come on top.
"""
from __future__ import annotations

import json
from typing import Any, NamedTuple

from hypothesis import strategies as st

from router.openai_request import CHAT_FIELDS, COMPLETION_FIELDS
from strata.v1 import strata_pb2

VOCAB = 4096                 # the bundled strata-moe-tiny
MAX_MODEL_LEN = 2048         # the router's default --max-model-len
NAN, INF = float("nan"), float("inf")
SURROGATE = "a\ud800b"       # JSON writes it as the escape "\ud800": valid JSON, not valid UTF-8 text


class HttpCase(NamedTuple):
    path: str
    body: bytes
    content_type: str
    bad: frozenset[str]      # params the answer may name; empty = must succeed

    def __repr__(self) -> str:  # a falsifying example's body may be a megabyte
        return f"HttpCase({self.path!r}, {len(self.body)} bytes: {_cut(self.body)}, {self.content_type!r}, " \
               f"bad={sorted(self.bad)})"


class GrpcCase(NamedTuple):
    payload: bytes           # the serialized GenerateRequest (or garbage)
    bad: frozenset[str]      # fields the status details may name; empty = must succeed; "*": any answer but a crash

    def __repr__(self) -> str:
        return f"GrpcCase({len(self.payload)} bytes: {_cut(self.payload)}, bad={sorted(self.bad)})"


def _cut(raw: bytes, keep: int = 2000) -> str:
    return repr(raw) if len(raw) <= keep else f"{raw[:keep]!r}..."


# ------------------------------------------------------------------------------------------------ shared values

_WORDS = st.sampled_from(["hello", "the", "cat", "sat", "on", "a", "mat", "strata", "router", "0", "!", " ", "\n",
                          "é", "日本", "🙂"])
SHORT_TEXT = st.lists(_WORDS, min_size=1, max_size=8).map(" ".join).filter(str.strip)
GOOD_IDS = st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=8)
HUGE_INTS = st.sampled_from([2**31, 2**32, 2**63, 2**64, 2**64 + 1, 10**30, -(2**63) - 1, 10**400])
OVERLONG = st.integers(5_000, 60_000).map(lambda n: "x" * n)


def _wrong_types(*accepted: str) -> st.SearchStrategy:
    """Values of every JSON type except the accepted ones (null is never hostile: it means "unset")."""
    kinds = {"int": st.integers(-5, 5), "float": st.sampled_from([0.5, 1.5, -2.25, NAN, INF, -INF, 1e308]),
             "bool": st.booleans(), "str": st.sampled_from(["", "1", "true", "x" * 40, SURROGATE]),
             "list": st.sampled_from([[], [1], ["a"], [[1]], [None]]),
             "dict": st.sampled_from([{}, {"a": 1}, {"type": "text"}])}
    if "float" in accepted:
        kinds.pop("int")
    return st.one_of([s for name, s in kinds.items() if name not in accepted])


def _int_field(lo: int, hi: int, bad_lo: int | None = None, bad_hi: int | None = None):
    """(valid, hostile) for an integer option valid in [lo, hi]."""
    hostile = [_wrong_types("int"), HUGE_INTS.filter(lambda v: not lo <= v <= hi)]
    if bad_lo is not None:
        hostile.append(st.integers(bad_lo, lo - 1))
    if bad_hi is not None:
        hostile.append(st.integers(hi + 1, bad_hi))
    return st.integers(lo, hi), st.one_of(hostile)


def _float_field(lo: float, hi: float, allowed: tuple[float, float], lo_open: bool = False):
    """(valid, hostile) for a number option the server allows in `allowed` ((lo, hi] when lo_open); the valid
    values drawn stay in [lo, hi] (cheap to run)."""
    # denormal and tiny values are valid too (they once failed the worker's float32 sampler)
    valid = st.one_of(st.floats(lo, hi), st.sampled_from([5e-324, 2.2250738585e-313, 1e-40]).filter(
        lambda v: allowed[0] < v or (allowed[0] == v and not lo_open)))
    out = st.one_of(st.floats(allowed[1], 1e300, exclude_min=True),
                    st.floats(-1e300, allowed[0], exclude_max=not lo_open),
                    st.sampled_from([NAN, INF, -INF]), st.just(10**400))
    return valid, st.one_of(_wrong_types("int", "float"), out)


_BOOL = (st.booleans(), _wrong_types("bool"))


# ------------------------------------------------------------------------------------------------ OpenAI bodies

def _openai_fields(chat: bool, model_id: str) -> dict[str, tuple[st.SearchStrategy, st.SearchStrategy]]:
    """field -> (valid, hostile) for the options both endpoints share and whose validity stands alone."""
    return {
        "model": (st.sampled_from(["", model_id]),
                  st.one_of(_wrong_types("str"), st.sampled_from(["no-such-model", model_id + "x", SURROGATE]))),
        "temperature": _float_field(0.0, 2.0, (0.0, 100.0)),
        "top_p": _float_field(0.05, 1.0, (0.0, 1.0), lo_open=True),
        "top_k": (st.integers(-1, 50), st.one_of(_wrong_types("int"), st.integers(-(2**40), -2),
                                                 st.sampled_from([2**32, 2**40, 2**64, 10**30]))),
        "seed": _int_field(0, 2**63 - 1, bad_lo=-(2**70)),
        "presence_penalty": _float_field(-2.0, 2.0, (-2.0, 2.0)),
        "frequency_penalty": _float_field(-2.0, 2.0, (-2.0, 2.0)),
        "repetition_penalty": _float_field(0.5, 2.0, (0.01, 10.0)),
        "ignore_eos": _BOOL,
        "include_stop_str_in_output": _BOOL,
        "prompt_logprobs": (st.integers(0, 2), st.one_of(_wrong_types("int"), st.integers(21, 10**6),
                                                         st.integers(-50, -1))),
        "stop": (st.one_of(SHORT_TEXT, st.lists(SHORT_TEXT, max_size=4)),
                 st.one_of(_wrong_types("str", "list"), st.just(""), st.just([""]), st.lists(st.integers(), min_size=1),
                           st.lists(SHORT_TEXT, min_size=65, max_size=300), st.just([SURROGATE]),
                           st.just([["nested"]]), OVERLONG.map(lambda s: [s]))),
        "stop_token_ids": (st.lists(st.integers(1, VOCAB - 1), max_size=4),
                           st.one_of(_wrong_types("list"), st.lists(st.integers(-(2**70), -1), min_size=1),
                                     st.lists(st.integers(VOCAB, 2**70), min_size=1), st.just([1.5]),
                                     st.just(["1"]), st.just([True]), st.lists(st.integers(1, 9), min_size=1025,
                                                                               max_size=1100))),
        "logit_bias": (st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=4),
                       st.one_of(_wrong_types("dict"), st.just({"abc": 1}), st.just({"1.5": 1}), st.just({"-1": 1}),
                                 st.just({str(VOCAB): 1}), st.just({"99999999999999999999999": 1}),
                                 st.just({"1": 100.5}), st.just({"1": NAN}), st.just({"1": INF}),
                                 st.just({"1": "x"}), st.just({"1": 10**400}), st.just({"1": None}),
                                 st.just({SURROGATE: 1}),
                                 st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.just(1.0), min_size=1025,
                                                 max_size=1100))),
        "cache_salt": (st.sampled_from(["", "tenant-a", "é"]), st.one_of(_wrong_types("str").filter(
            lambda v: not isinstance(v, str) or v == SURROGATE), OVERLONG)),
        "speculative": (st.just("off"), st.one_of(_wrong_types("str"), st.sampled_from(["bogus", "ngram", "eagle",
                                                                                       "OFF"]))),
        "response_format": (st.just({"type": "text"}), st.one_of(st.sampled_from(
            [{"type": "json_object"}, {"type": "json_schema"}, "text", 5, [], True]))),
        "tools": (st.just([]), st.just([{"type": "function", "function": {"name": "f"}}])),
        "user": (st.sampled_from(["", "alice"]), _wrong_types("str").filter(lambda v: not isinstance(v, str)
                                                                            or v == SURROGATE)),
        "metadata": (st.dictionaries(st.sampled_from(["k", "team"]), st.sampled_from(["v", ""]), max_size=2),
                     st.one_of(_wrong_types("dict"), st.just({"k": 1}), st.just({"k": [1]}))),
        "store": (st.booleans(), _wrong_types("bool")),
        "service_tier": (st.sampled_from(["auto", "default"]), _wrong_types("str").filter(
            lambda v: not isinstance(v, str))),
    }


@st.composite
def _fields(draw, table: dict, p_hostile: float) -> tuple[dict[str, Any], set[str]]:
    """Each field of `table`: left out (most), valid, or hostile (with probability p_hostile once present)."""
    body, bad = {}, set()
    for name, (valid, hostile) in table.items():
        if not draw(st.integers(0, 9)) < 3:
            continue
        if draw(st.floats(0, 1)) < p_hostile:
            body[name] = draw(hostile)
            bad.add(name)
        else:
            body[name] = draw(valid)
    return body, bad


@st.composite
def _max_tokens(draw, body: dict, bad: set[str]) -> None:
    """Always some max_tokens: a valid request stays cheap (<= 4 tokens)."""
    key = draw(st.sampled_from(["max_tokens", "max_tokens", "max_completion_tokens"]))
    if draw(st.integers(0, 9)) < 2:
        body[key] = draw(st.one_of(_wrong_types("int"), st.integers(-(2**70), 0),
                                   st.integers(MAX_MODEL_LEN, 2**70), HUGE_INTS))
        bad.add(key)
    else:
        body[key] = draw(st.integers(1, 4))
    if draw(st.integers(0, 9)) == 0:  # min_tokens: valid up to max_tokens
        limit = body[key] if key not in bad else 4
        hostile = draw(st.booleans())
        body["min_tokens"] = draw(st.one_of(st.integers(-(2**40), -1), st.integers(MAX_MODEL_LEN, 2**40),
                                            _wrong_types("int"))) if hostile else draw(st.integers(0, limit))
        if hostile:
            bad.add("min_tokens")


@st.composite
def _choices(draw, body: dict, bad: set[str]) -> None:
    """n (valid 1..2), stream / stream_options, best_of (valid = n)."""
    roll = draw(st.integers(0, 9))
    if roll < 2:
        body["n"] = draw(st.one_of(_wrong_types("int"), st.integers(-(2**40), 0), st.integers(17, 2**40), HUGE_INTS))
        bad.add("n")
    elif roll < 4:
        body["n"] = draw(st.integers(1, 2))
        if draw(st.booleans()):
            body["best_of"] = body["n"]
    stream = draw(st.sampled_from([None, None, False, True]))
    if stream is not None:
        body["stream"] = stream
    roll = draw(st.integers(0, 9))
    if roll == 0:
        body["stream"] = draw(_wrong_types("bool"))
        bad.add("stream")
    elif roll == 1:
        body["stream_options"] = draw(st.one_of(_wrong_types("dict"), st.just({"include_usage": "yes"}),
                                                st.just({"bogus": True})))
        bad.add("stream_options")
    elif roll == 2 and body.get("stream") is True:
        body["stream_options"] = {"include_usage": draw(st.booleans())}
    elif roll == 3 and body.get("stream") is not True:
        body["stream_options"] = {"include_usage": True}   # only allowed with stream: true
        bad.add("stream_options")


_PROMPT_HOSTILE = st.one_of(
    _wrong_types("str", "list").filter(lambda v: v != SURROGATE), st.just(""), st.just([]), st.just([[]]),
    st.lists(st.integers(-(2**40), -1), min_size=1, max_size=4), st.lists(st.integers(VOCAB, 2**70), min_size=1,
                                                                           max_size=4),
    st.just([1.5, 2]), st.just([True]), st.just([["a"]]), st.just([[1], "x", 3]), st.just(SURROGATE),
    st.just([SURROGATE]), st.integers(MAX_MODEL_LEN, 12_000).map(lambda n: " ".join(["strata"] * n)),
    st.lists(st.integers(1, 9), min_size=MAX_MODEL_LEN, max_size=MAX_MODEL_LEN + 10),
    st.lists(SHORT_TEXT, min_size=65, max_size=80), st.integers(3, 60).map(lambda d: json.loads("[" * d + "]" * d)))


@st.composite
def completion_body(draw, model_id: str) -> tuple[dict, set[str]]:
    body, bad = draw(_fields(_openai_fields(False, model_id), 0.25))
    if draw(st.integers(0, 9)) < 2:
        body["prompt"] = draw(_PROMPT_HOSTILE)
        bad.update({"prompt", "body"})   # body: a nest deeper than the server parses
    else:
        one = st.one_of(SHORT_TEXT, GOOD_IDS)
        body["prompt"] = draw(st.one_of(one, one, st.lists(one, min_size=1, max_size=3)))
    if draw(st.integers(0, 9)) == 0:
        body["echo"] = draw(st.booleans())
    if draw(st.integers(0, 9)) == 0:
        body["logprobs"] = draw(st.integers(0, 5))
    elif draw(st.integers(0, 19)) == 0:
        body["logprobs"] = draw(st.one_of(_wrong_types("int"), st.integers(21, 2**40), st.integers(-99, -1)))
        bad.add("logprobs")
    if draw(st.integers(0, 29)) == 0:
        key = draw(st.sampled_from(["suffix", "top_logprobs", "functions"]))
        body[key] = draw(st.sampled_from(["x", 3, [1]]))
        bad.add("tools" if key == "functions" else key)   # the answer names tools for both
    return body, bad


_ROLES = st.sampled_from(["system", "user", "assistant", "developer"])
_GOOD_MESSAGE = st.builds(lambda role, text, parts: {"role": role, "content": [{"type": "text", "text": text}]
                                                     if parts else text}, _ROLES, SHORT_TEXT, st.booleans())
_BAD_MESSAGE = st.sampled_from([
    5, "hi", None, [], {"content": "x"}, {"role": "bogus", "content": "x"}, {"role": 3, "content": "x"},
    {"role": "user", "content": 5}, {"role": "user", "content": {"text": "x"}},
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]},
    {"role": "user", "content": ["x"]}, {"role": "user", "content": [5]}, {"role": "user", "content": SURROGATE},
    {"role": "user", "content": [{"type": "text", "text": SURROGATE}]}, {"role": SURROGATE, "content": "x"}])


@st.composite
def chat_body(draw, model_id: str) -> tuple[dict, set[str]]:
    body, bad = draw(_fields(_openai_fields(True, model_id), 0.25))
    roll = draw(st.integers(0, 9))
    if roll < 2:
        good = draw(st.lists(_GOOD_MESSAGE, max_size=2))
        body["messages"] = good + [draw(_BAD_MESSAGE)] + draw(st.lists(_GOOD_MESSAGE, max_size=1))
        bad.add("messages")
    elif roll == 2:
        body["messages"] = draw(st.one_of(_wrong_types("list"), st.just([]),
                                          st.lists(_GOOD_MESSAGE, min_size=1, max_size=2).map(
                                              lambda m: {"messages": m})))
        bad.add("messages")
    else:
        body["messages"] = draw(st.lists(_GOOD_MESSAGE, min_size=1, max_size=3))
    logprobs = draw(st.sampled_from([None, None, False, True, "x"]))
    if logprobs is not None:
        body["logprobs"] = logprobs
        if logprobs == "x":
            bad.add("logprobs")
    if draw(st.integers(0, 4)) == 0:
        top = draw(st.one_of(st.integers(0, 5), st.integers(21, 2**40), st.integers(-9, -1), _wrong_types("int")))
        body["top_logprobs"] = top
        if not (isinstance(top, int) and not isinstance(top, bool) and 0 <= top <= 20 and logprobs is True):
            bad.add("top_logprobs")
    if draw(st.integers(0, 29)) == 0:
        body[draw(st.sampled_from(["echo", "prompt", "suffix"]))] = "x"   # completion-only options
        bad.update({"echo", "prompt", "suffix"} & set(body))
    return body, bad


@st.composite
def openai_case(draw, model_id: str) -> HttpCase:
    """A JSON body for one of the two endpoints (wrong endpoint-specific fields included), sometimes wrapped in a
    non-object, an unknown field, a non-JSON body or a deep nest, sent with a random content type."""
    chat = draw(st.booleans())
    body, bad = draw(chat_body(model_id) if chat else completion_body(model_id))
    draw(_max_tokens(body, bad))
    draw(_choices(body, bad))
    if draw(st.integers(0, 14)) == 0:
        name = draw(st.sampled_from(["temprature", "max_token", "prompt_ids", "x" * 300, "", SURROGATE, "1"]))
        body[name] = draw(st.sampled_from([1, "x", None, {}]))
        bad.add(name if name not in (CHAT_FIELDS if chat else COMPLETION_FIELDS) else "_unused")
    raw = json.dumps(body)
    roll = draw(st.integers(0, 24))
    if roll == 0:
        raw, bad = json.dumps(draw(st.sampled_from([[body], "text", 5, None, True]))), {"body"}
    elif roll == 1:
        raw, bad = draw(st.sampled_from(["", "{", "{'a': 1}", "prompt=hi&max_tokens=2", "\x00\xff",
                                         raw[: max(1, len(raw) // 2)], raw + "}", "[" * 100_000,
                                         '{"prompt": ' + "[" * 50_000 + "]" * 50_000 + "}",
                                         '{"max_tokens": ' + "9" * 5000 + "}"])), {"body"}
    elif roll == 2:
        depth = draw(st.sampled_from([900, 990, 3000, 100_000]))
        raw = raw[:-1] + (", " if len(body) else "") + '"metadata": ' + "[" * depth + "]" * depth + "}"
        bad = set(bad) | {"body", "metadata"}
    content_type = draw(st.sampled_from(["application/json", "application/json", "text/plain",
                                         "application/x-www-form-urlencoded", "", "application/json; charset=latin-1"]))
    if draw(st.integers(0, 29)) == 0:
        encoded = raw.encode("utf-16")
        bad = {"body"}
    else:
        encoded = raw.encode("utf-8", "surrogatepass")
    return HttpCase("/v1/chat/completions" if chat else "/v1/completions", encoded, content_type, frozenset(bad))


# ------------------------------------------------------------------------------------------------ gRPC

_UINT32 = 2**32 - 1


@st.composite
def generate_request(draw) -> tuple[strata_pb2.GenerateRequest, set[str]]:
    """A GenerateRequest with hostile values where the wire types allow them (uint32 cannot be negative)."""
    req, bad = strata_pb2.GenerateRequest(), set()
    s = req.sampling

    def pick(name: str, valid: st.SearchStrategy, hostile: st.SearchStrategy, target=s, p_hostile: float = 0.2):
        if draw(st.integers(0, 9)) < 3:
            if draw(st.floats(0, 1)) < p_hostile:
                value = draw(hostile)
                bad.add(f"sampling.{name}" if target is s else name)
            else:
                value = draw(valid)
            if isinstance(value, list):
                getattr(target, name).extend(value)
            elif isinstance(value, dict):
                getattr(target, name).update(value)
            else:
                setattr(target, name, value)

    roll = draw(st.integers(0, 9))
    if roll == 0:
        choice = draw(st.sampled_from(["none", "empty_text", "empty_ids", "oov", "huge"]))
        if choice == "empty_text":
            req.text = ""
        elif choice == "empty_ids":
            req.token_ids.SetInParent()
        elif choice == "oov":
            req.token_ids.ids.extend(draw(st.lists(st.integers(VOCAB, _UINT32), min_size=1, max_size=4)) + [1])
        elif choice == "huge":
            req.text = " ".join(["strata"] * draw(st.integers(MAX_MODEL_LEN, 8000)))
        bad.add("prompt")
    elif draw(st.booleans()):
        req.text = draw(SHORT_TEXT)
    else:
        req.token_ids.ids.extend(draw(GOOD_IDS))
    pick("model", st.sampled_from(["", "strata-moe-tiny"]), st.sampled_from(["nope", "x" * 1000]), target=req)
    pick("request_id", st.just(""), st.integers(257, 5000).map(lambda n: "r" * n), target=req)
    pick("cache_salt", st.sampled_from(["", "t"]), st.nothing(), target=req, p_hostile=0)
    if draw(st.integers(0, 9)) < 2:
        s.max_tokens = draw(st.one_of(st.just(0), st.integers(MAX_MODEL_LEN, _UINT32)))
        bad.add("sampling.max_tokens")
    else:
        s.max_tokens = draw(st.integers(1, 4))
    pick("temperature", st.one_of(st.floats(0, 2), st.just(2.2250738585e-313)),
         st.one_of(st.floats(100.0, 1e308, exclude_min=True), st.floats(-1e308, 0, exclude_max=True),
                   st.sampled_from([NAN, INF, -INF])))
    pick("top_k", st.integers(0, 50), st.nothing(), p_hostile=0)
    pick("top_p", st.one_of(st.floats(0.05, 1.0), st.just(1e-300)),
         st.one_of(st.floats(1.0, 1e308, exclude_min=True), st.floats(-1e308, 0.0), st.just(NAN)))
    pick("seed", st.integers(0, 2**63 - 1), st.integers(2**63, 2**64 - 1))
    pick("stop", st.lists(SHORT_TEXT, max_size=4), st.one_of(st.just([""]), st.lists(SHORT_TEXT, min_size=65,
                                                                                    max_size=200)))
    pick("stop_token_ids", st.lists(st.integers(1, VOCAB - 1), max_size=4),
         st.lists(st.integers(VOCAB, _UINT32), min_size=1, max_size=3))
    pick("repetition_penalty", st.floats(0.5, 2.0), st.one_of(st.floats(-1e308, 0.01, exclude_max=True),
                                                              st.floats(10.0, 1e308, exclude_min=True), st.just(NAN)))
    for name in ("presence_penalty", "frequency_penalty"):
        pick(name, st.floats(-2, 2), st.one_of(st.floats(2.0, 1e308, exclude_min=True), st.just(NAN),
                                               st.floats(-1e308, -2.0, exclude_max=True)))
    pick("logprobs", st.integers(0, 5), st.integers(21, _UINT32))
    pick("prompt_logprobs", st.integers(0, 2), st.integers(21, _UINT32))
    pick("logit_bias", st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=4),
         st.one_of(st.dictionaries(st.integers(VOCAB, _UINT32), st.just(1.0), min_size=1, max_size=2),
                   st.just({1: NAN}), st.just({1: 100.5}), st.just({1: -INF})))
    pick("speculative", st.sampled_from(["", "off"]), st.sampled_from(["bogus", "ngram", "eagle", "\x00"]))
    if draw(st.integers(0, 19)) == 0:
        s.min_tokens = draw(st.integers(min(s.max_tokens + 1, _UINT32), _UINT32))  # at the top: max_tokens is bad
        bad.add("sampling.min_tokens")
    for name in ("skip_text", "include_prompt_token_ids", "include_metrics"):
        setattr(req.stream_options, name, draw(st.booleans()))
    return req, bad


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append(value & 0x7F | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    """One protobuf field on the wire: its tag, then its length (length-delimited) and payload."""
    if wire == 2:
        return _varint(number << 3 | 2) + _varint(len(payload)) + payload
    return _varint(number << 3 | wire) + payload


@st.composite
def grpc_case(draw) -> GrpcCase:
    """A serialized hostile GenerateRequest, or bytes that are not one: random, truncated, bit-flipped, invalid
    UTF-8 in a string field, a wrong wire type."""
    req, bad = draw(generate_request())
    payload = req.SerializeToString()
    roll = draw(st.integers(0, 9))
    if roll == 0:
        return GrpcCase(draw(st.binary(min_size=1, max_size=200)), frozenset({"*"}))
    if roll == 1 and len(payload) > 1:
        cut = draw(st.integers(1, len(payload) - 1))
        flipped = bytearray(payload)
        flipped[draw(st.integers(0, len(payload) - 1))] ^= 1 << draw(st.integers(0, 7))
        return GrpcCase(draw(st.sampled_from([payload[:cut], bytes(flipped)])), frozenset({"*"}))
    if roll == 2:
        bad_utf8 = draw(st.sampled_from([b"\xff", b"\xed\xa0\x80", b"a\xc3", b"\xc0\xaf"]))
        where = draw(st.sampled_from([(2, "text"), (1, "model"), (5, "request_id"), (6, "cache_salt"),
                                      (4, "sampling.stop"), (4, "sampling.speculative")]))
        number, name = where
        if name == "sampling.stop":
            extra = _field(4, 2, _field(6, 2, bad_utf8))
        elif name == "sampling.speculative":
            extra = _field(4, 2, _field(20, 2, bad_utf8))
        else:
            extra = _field(number, 2, bad_utf8)
        return GrpcCase(payload + extra, frozenset({name}))
    if roll == 3:
        # field 4 (sampling, a message) as a varint; field 1 (model, a string) as a fixed64
        extra = draw(st.sampled_from([_field(4, 0, b"\x01"), _field(1, 1, b"\x00" * 8), b"\xff\xff\xff\xff\x0f",
                                      _field(3, 2, b"\x08")]))  # token_ids.ids: a varint cut short
        return GrpcCase(payload + extra, frozenset({"*"}))
    return GrpcCase(payload, frozenset(bad))
