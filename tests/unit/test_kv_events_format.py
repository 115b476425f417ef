"""`--kv-events-format` (issue 18): current vLLM's shape by default, the older releases' shapes by name, on the
worker CLI and in its config; a name no preset has is refused naming the allowed ones."""
from __future__ import annotations

import pytest

from kvstore.events import WIRE_PRESETS, WireOptions
from worker_common.cli import parse_config
from worker_common.config import WorkerConfig


def test_the_default_is_current_vllms_shape():
    assert WireOptions() == WIRE_PRESETS["vllm"] == WireOptions("map", "bytes", "topic")
    assert WireOptions.preset("vllm-0.25") == WireOptions("map", replay="bare")
    assert WireOptions.preset("vllm-0.23") == WireOptions("array", replay="bare")
    with pytest.raises(ValueError, match=r"KV-event format must be one of \['vllm', 'vllm-0.23', 'vllm-0.25'\]"):
        WireOptions.preset("vllm-0.9")
    with pytest.raises(ValueError, match="replay framing must be one of"):
        WireOptions(replay="other")


def test_the_worker_flag_reaches_its_config():
    assert parse_config("prefill", []).kv_events_format == "vllm"
    assert parse_config("decode", ["--kv-events-format", "vllm-0.23"]).kv_events_format == "vllm-0.23"
    with pytest.raises(SystemExit):
        parse_config("decode", ["--kv-events-format", "array"])
    with pytest.raises(ValueError, match="kv_events_format must be one of"):
        WorkerConfig(role="prefill", model="-", kv_events_format="array")
