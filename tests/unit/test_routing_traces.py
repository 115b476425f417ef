"""The routing grid's generated traffic (benchmarks/conversation_trace.py, benchmarks/azure_trace.py): Mooncake
format, the prefix structure each module's docstring states, deterministic per seed."""
from __future__ import annotations

import csv
import math
import sys
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))  # as when run as a script: the trace modules sit side by side

import azure_trace  # noqa: E402
import conversation_trace as conv  # noqa: E402
import mooncake_trace  # noqa: E402

BLOCK = mooncake_trace.TRACE_BLOCK


def make_conversations(**changes) -> list:
    return conv.conversation_trace(conv.ConversationConfig(**{"sessions": 40, **changes}))


def assert_mooncake_shape(trace) -> None:
    assert all(len(r.hash_ids) == math.ceil(r.input_length / BLOCK) for r in trace)
    assert all(a.ts_s <= b.ts_s for a, b in zip(trace, trace[1:]))


# ------------------------------------------------------------------------------------------ conversations

def test_every_conversation_request_starts_with_the_shared_system_block():
    trace = make_conversations()
    assert_mooncake_shape(trace)
    assert {r.hash_ids[0] for r in trace} == {conv.SYSTEM_BLOCK_ID}
    assert len({r.hash_ids[1] for r in trace if len(r.hash_ids) > 1}) > 1  # block 1 is the session's own


def test_each_turn_extends_the_previous_prompt_and_answer():
    """One session: turn t+1's prompt holds turn t's prompt and answer, so turn t's full blocks come back with the
    same ids; its partial last block does not (it holds more tokens now)."""
    trace = make_conversations(sessions=1, mean_turns=1_000, max_prompt_tokens=20_000)
    assert len(trace) > 3
    for prev, turn in zip(trace, trace[1:]):
        full = prev.input_length // BLOCK
        assert turn.hash_ids[:full] == prev.hash_ids[:full]
        assert turn.input_length > prev.input_length + prev.output_length  # + the new user message
        if prev.input_length % BLOCK:
            assert prev.hash_ids[-1] not in turn.hash_ids
        assert turn.ts_s > prev.ts_s  # a think time apart


def test_conversation_trace_is_deterministic_per_seed():
    assert make_conversations(seed=3) == make_conversations(seed=3)
    assert make_conversations(seed=3) != make_conversations(seed=4)


def test_conversation_defaults_are_the_grid_trace():
    trace = conv.conversation_trace()
    assert len(trace) == 2_958
    assert round(sum(r.input_length for r in trace) / len(trace)) == 9_313


def test_conversation_config_rejects_bad_values():
    with pytest.raises(ValueError, match="sessions"):
        conv.ConversationConfig(sessions=0)
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        conv.ConversationConfig(max_prompt_tokens=100)


def test_dumped_trace_loads_back_equal(tmp_path):
    trace = make_conversations()
    path = tmp_path / "conv.jsonl"
    path.write_text(mooncake_trace.dump_trace(trace))
    assert mooncake_trace.load_trace(path) == trace


# ------------------------------------------------------------------------------------------------- Azure

def csv_rows(name: str, limit: int) -> list[tuple[int, int]]:
    with azure_trace.AZURE_TRACES[name].open() as f:
        return [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for _, r in zip(range(limit), csv.DictReader(f))]


@pytest.mark.parametrize("name", ["code", "conv"])
def test_azure_trace_keeps_the_csv_arrivals_and_lengths(name):
    trace = azure_trace.azure_trace(name, limit=500)
    assert_mooncake_shape(trace)
    assert trace[0].ts_s == 0.0
    assert [(r.input_length, r.output_length) for r in trace] == csv_rows(name, 500)


def test_azure_requests_share_only_their_apps_prefix_and_keep_their_last_block():
    trace = azure_trace.azure_trace("code", limit=2_000)
    app_ids = [tuple(i for i in r.hash_ids if i >= azure_trace.APP_ID_BASE) for r in trace]
    assert all(ids == r.hash_ids[:len(ids)] for ids, r in zip(app_ids, trace))  # app blocks lead
    last_ids = [r.hash_ids[-1] for r in trace]
    assert len(set(last_ids)) == len(trace) and all(i < azure_trace.APP_ID_BASE for i in last_ids)
    (_, top), = Counter(ids[0] for ids in app_ids if ids).most_common(1)
    assert top > len(trace) / 10  # Zipf(1) over 128 apps: the first draws about a fifth of the requests


def test_azure_trace_is_deterministic_per_seed_and_rejects_unknown_names():
    cfg = azure_trace.AzurePrefixConfig(seed=1)
    assert azure_trace.azure_trace("conv", cfg, 300) == azure_trace.azure_trace("conv", cfg, 300)
    assert azure_trace.azure_trace("conv", cfg, 300) != azure_trace.azure_trace("conv", limit=300)
    with pytest.raises(ValueError, match="name must be one of"):
        azure_trace.azure_trace("chat")
