"""Proto <-> engine conversion at the worker edge: defaults, optional fields, errors that name the field."""
from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams
from kvstore.hashing import Namespace, hash_blocks
from strata.v1 import common_pb2
from worker_common.config import WorkerConfig
from worker_common.convert import (InvalidArgument, check_handle, check_prompt, sampling_from_proto,
                                   sampling_to_proto, stop_reason_fields)

FP = Namespace("m", "bs4", "float32").fingerprint()


def test_unset_fields_take_the_documented_defaults():
    params = sampling_from_proto(common_pb2.SamplingParams())
    assert params == SamplingParams(max_tokens=64, temperature=0.0, top_p=1.0, seed=None)


def test_round_trip_keeps_every_field_and_seed_zero():
    params = SamplingParams(max_tokens=5, temperature=0.9, top_k=7, top_p=0.5, seed=0, stop=("x",),
                            stop_token_ids=(3,), ignore_eos=True, include_stop_str_in_output=True)
    assert sampling_from_proto(sampling_to_proto(params)) == params


@pytest.mark.parametrize("msg,field", [
    (common_pb2.SamplingParams(max_tokens=0), "sampling.max_tokens"),
    (common_pb2.SamplingParams(top_p=1.5), "sampling.top_p"),
    (common_pb2.SamplingParams(top_p=0.0), "sampling.top_p"),
    (common_pb2.SamplingParams(temperature=-1), "sampling.temperature"),
])
def test_out_of_range_sampling_names_the_field(msg, field):
    with pytest.raises(InvalidArgument, match=field):
        sampling_from_proto(msg)


def test_prompt_checks():
    assert check_prompt([1, 2], vocab_size=10, max_model_len=8) == [1, 2]
    with pytest.raises(InvalidArgument, match="must not be empty"):
        check_prompt([], 10, 8)
    with pytest.raises(InvalidArgument, match=r"\[0, 10\)"):
        check_prompt([3, 10], 10, 8)
    with pytest.raises(InvalidArgument, match="max_model_len"):
        check_prompt(list(range(8)), 10, 8)


def make_handle(tokens: list[int], block_size: int = 4) -> common_pb2.KvHandle:
    hashes = hash_blocks(FP, tokens, block_size)
    return common_pb2.KvHandle(namespace_fingerprint=FP, block_size=block_size, block_hashes=hashes,
                               num_tokens=len(hashes) * block_size,
                               blocks=[common_pb2.BlockLocation(backend="shm") for _ in hashes])


def test_handle_invariants():
    check_handle(common_pb2.KvHandle(), 5)                    # empty handle: recompute everything
    check_handle(make_handle(list(range(9))), 9)
    bad = make_handle(list(range(9)))
    del bad.blocks[-1]
    with pytest.raises(InvalidArgument, match="kv.blocks"):
        check_handle(bad, 9)
    with pytest.raises(InvalidArgument, match="cover 8 tokens"):
        check_handle(make_handle(list(range(9))), 7)
    short_fp = make_handle(list(range(9)))
    short_fp.namespace_fingerprint = b"x"
    with pytest.raises(InvalidArgument, match="namespace_fingerprint"):
        check_handle(short_fp, 9)


def test_stop_reason_is_unset_for_end_of_sequence():
    params = SamplingParams(stop_token_ids=(7,))
    assert stop_reason_fields("ab", 7, params) == {"stop_str": "ab"}
    assert stop_reason_fields(None, 7, params) == {"stop_token_id": 7}
    assert stop_reason_fields(None, 2, params) == {}


@pytest.mark.parametrize("field,value", [("role", "router"), ("transfer", "rdma"), ("port", 70000),
                                         ("lease_ttl_s", 0), ("transfer_deadline_s", -1),
                                         ("redis_url", "http://x")])
def test_worker_config_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        WorkerConfig(**{"role": "prefill", "model": "m", field: value})
