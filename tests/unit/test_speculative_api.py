"""A request's `speculative` field and the workers' speculative counters, without processes (issue 13 items 4-5):
both doors validate the field naming it; the router refuses a drafter no decode worker loaded and routes to one
that did; the worker converts the field and refuses a drafter it did not load; counters become
`SpeculativeStats`, `strata_spec_*` metrics and `strata workers` rows."""
from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from engine.config import SpeculativeConfig
from engine.sampling_params import SamplingParams
from engine.spec.speculation import SpecStats
from router.dispatch import Dispatcher
from router.openai_request import from_completion
from router.registry import ModelFacts, SpecFigures, WorkerRecord, WorkerRegistry
from router.service import RegistryService, spec_from_proto, view_to_proto
from router.validation import ApiError, ModelLimits, from_grpc
from strata.cli_cache import _speculative_cell, worker_dict
from strata.v1 import common_pb2, router_pb2, strata_pb2
from worker_common.convert import InvalidArgument, check_speculative, sampling_from_proto, sampling_to_proto
from worker_common.spec_stats import SpecCollector, speculative_stats

MODELS = {"tiny": ModelLimits("tiny", max_model_len=64, vocab_size=100)}


def make_speculation(method: str = "ngram", drafted: int = 10, accepted: int = 6, verifies: int = 4,
                     emitted: int = 10) -> SimpleNamespace:
    """What the worker reads of the engine's `Speculation`: config, drafters, stats."""
    stats = SpecStats(method=method, num_verifies=verifies, num_draft_tokens=drafted, num_accepted_tokens=accepted,
                      num_emitted_tokens=emitted, draft_seconds=0.25, verify_seconds=1.5)
    drafters = {"ngram": object(), method: object()}
    return SimpleNamespace(config=SpeculativeConfig(method, 5), drafters=drafters, stats=stats)


def grpc_request(**sampling) -> strata_pb2.GenerateRequest:
    return strata_pb2.GenerateRequest(text="hello", sampling=common_pb2.SamplingParams(**sampling))


def make_record(wid: str, role: str = "decode", methods: tuple[str, ...] = ()) -> WorkerRecord:
    return WorkerRecord(wid, role, f"{wid}:1", ModelFacts("tiny"), speculative_methods=methods)


# ---- the two doors ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, want", [("", None), ("off", "off"), ("ngram", "ngram"), ("eagle", "eagle")])
def test_grpc_speculative_is_unset_off_or_a_drafter(value, want):
    assert from_grpc(grpc_request(speculative=value), MODELS).sampling.speculative == want


def test_grpc_unknown_speculative_is_invalid_argument_naming_the_field_and_the_choices():
    with pytest.raises(ApiError) as info:
        from_grpc(grpc_request(speculative="medusa"), MODELS)
    err = info.value
    assert (err.code, err.param) == (grpc.StatusCode.INVALID_ARGUMENT, "sampling.speculative")
    assert err.message.startswith("sampling.speculative must be one of off, ngram, draft, eagle")


@pytest.mark.parametrize("value", ["off", "ngram", "draft", None])
def test_openai_takes_speculative_as_an_extra_body_field(value):
    body = {"prompt": "hi", **({} if value is None else {"speculative": value})}
    params, _ = from_completion(body, MODELS, "r1")
    assert params.sampling.speculative == value


@pytest.mark.parametrize("value", ["medusa", "", 3, True, ["ngram"]])
def test_openai_bad_speculative_is_400_naming_the_field(value):
    with pytest.raises(ApiError) as info:
        from_completion({"prompt": "hi", "speculative": value}, MODELS, "r1")
    assert (info.value.code, info.value.param) == (grpc.StatusCode.INVALID_ARGUMENT, "speculative")
    assert "one of off, ngram, draft, eagle" in info.value.message


# ---- the router knows which decode workers loaded which drafter ----------------------------------------------------

def make_registry() -> WorkerRegistry:
    registry = WorkerRegistry()
    registry.register(make_record("p0", "prefill"))
    registry.register(make_record("d-plain"))
    registry.register(make_record("d-draft", methods=("draft", "ngram")))
    return registry


def check_drafter(registry: WorkerRegistry, wanted: str | None, param: str = "speculative") -> None:
    Dispatcher({}, registry, None, None, {})._check_drafter("tiny", wanted, param)


def test_a_drafter_some_decode_worker_loaded_is_routed_to_one_that_did():
    registry = make_registry()
    for wanted in (None, "off", "ngram", "draft"):
        check_drafter(registry, wanted)
    view = registry.load_view("tiny", speculative="draft")
    assert [w.worker_id for w in view.decode_workers()] == ["d-draft"]
    assert [w.worker_id for w in view.prefill_workers()] == ["p0"]
    assert len(registry.load_view("tiny").decode_workers()) == 2


def test_a_drafter_no_decode_worker_loaded_is_invalid_argument_naming_the_field():
    with pytest.raises(ApiError) as info:
        check_drafter(make_registry(), "eagle", "sampling.speculative")
    err = info.value
    assert (err.code, err.param) == (grpc.StatusCode.INVALID_ARGUMENT, "sampling.speculative")
    assert err.message == ("sampling.speculative 'eagle' is not available: the decode workers of model 'tiny' run "
                           "draft, ngram (start them with --speculative eagle); 'off' always works")


def test_without_a_speculating_decode_worker_only_off_passes():
    registry = WorkerRegistry()
    registry.register(make_record("d-plain"))
    check_drafter(registry, "off")
    with pytest.raises(ApiError, match="do not speculate"):
        check_drafter(registry, "ngram")


def test_without_any_ready_decode_worker_routing_answers_instead():
    """UNAVAILABLE (no decode worker) is routing's answer, whatever the request asks for."""
    registry = WorkerRegistry()
    registry.register(make_record("p0", "prefill"))
    check_drafter(registry, "eagle")
    assert registry.speculative_methods("tiny") is None


def test_registration_and_heartbeats_carry_the_drafters_and_counters_to_list_workers():
    registry = WorkerRegistry()
    info = common_pb2.WorkerInfo(id="d0", role=common_pb2.WORKER_ROLE_DECODE, address="d0:1",
                                 model=common_pb2.ModelInfo(id="tiny"),
                                 speculative=common_pb2.SpeculativeStats(method="ngram", methods=["ngram"]))
    RegistryService(registry).RegisterWorker(router_pb2.RegisterWorkerRequest(worker=info), context=None)
    assert view_to_proto(registry.get("d0"), {}).speculative.method == "ngram", "known from the registration"
    stats = speculative_stats(make_speculation())
    registry.heartbeat("d0", speculative=spec_from_proto(stats, True))
    assert registry.speculative_methods("tiny") == {"ngram"}
    listed = view_to_proto(registry.get("d0"), {}).speculative
    assert (listed.method, list(listed.methods), listed.draft_tokens, listed.accepted_tokens) == ("ngram",
                                                                                                  ["ngram"], 10, 6)
    assert listed.acceptance_rate == 0.6 and listed.mean_accepted_length == 2.5
    registry.heartbeat("d0", speculative=spec_from_proto(common_pb2.SpeculativeStats(), False))
    assert registry.get("d0").speculative == SpecFigures("ngram", 5, 4, 10, 6, 10, 0.25, 1.5), \
        "a heartbeat without counters keeps the last ones"


def test_a_worker_that_does_not_speculate_lists_no_speculative_stats():
    registry = WorkerRegistry()
    registry.register(make_record("d-plain"))
    assert not view_to_proto(registry.get("d-plain"), {}).HasField("speculative")


# ---- the worker ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [None, "off", "ngram", "eagle"])
def test_the_field_round_trips_between_router_and_worker(value):
    params = SamplingParams(max_tokens=4, speculative=value)
    assert sampling_from_proto(sampling_to_proto(params)).speculative == value


def test_a_worker_refuses_a_drafter_it_did_not_load_naming_the_field():
    with pytest.raises(InvalidArgument, match=r"^sampling\.speculative must be one of"):
        sampling_from_proto(common_pb2.SamplingParams(speculative="medusa"))
    speculation = make_speculation("draft")
    for ok in (None, "off", "ngram", "draft"):
        check_speculative(SamplingParams(speculative=ok), speculation)
    with pytest.raises(InvalidArgument) as info:
        check_speculative(SamplingParams(speculative="eagle"), speculation)
    assert str(info.value) == ("sampling.speculative 'eagle' is not available: this decode worker runs draft, ngram "
                               "(start it with --speculative eagle); 'off' always works")
    check_speculative(SamplingParams(speculative="off"), None)
    with pytest.raises(InvalidArgument, match="does not speculate"):
        check_speculative(SamplingParams(speculative="ngram"), None)


def test_speculative_stats_are_the_engine_counters_and_their_ratios():
    stats = speculative_stats(make_speculation("draft"))
    assert (stats.method, list(stats.methods), stats.num_speculative_tokens) == ("draft", ["draft", "ngram"], 5)
    assert (stats.verifies, stats.draft_tokens, stats.accepted_tokens, stats.emitted_tokens) == (4, 10, 6, 10)
    assert (stats.draft_seconds, stats.verify_seconds) == (0.25, 1.5)
    assert (stats.acceptance_rate, stats.mean_accepted_length) == (0.6, 2.5)
    assert speculative_stats(None) is None
    empty = speculative_stats(make_speculation(drafted=0, accepted=0, verifies=0, emitted=0))
    assert (empty.acceptance_rate, empty.mean_accepted_length) == (0.0, 0.0)


def test_prometheus_exports_the_counters_and_gauges_per_worker():
    registry = CollectorRegistry()
    registry.register(SpecCollector("decode-0", lambda: speculative_stats(make_speculation())))
    text = generate_latest(registry).decode()
    for line in ['strata_spec_draft_tokens_total{worker="decode-0"} 10.0',
                 'strata_spec_accepted_tokens_total{worker="decode-0"} 6.0',
                 'strata_spec_verifies_total{worker="decode-0"} 4.0',
                 'strata_spec_emitted_tokens_total{worker="decode-0"} 10.0',
                 'strata_spec_draft_seconds_total{worker="decode-0"} 0.25',
                 'strata_spec_verify_seconds_total{worker="decode-0"} 1.5',
                 'strata_spec_acceptance_rate{worker="decode-0"} 0.6',
                 'strata_spec_mean_accepted_length{worker="decode-0"} 2.5']:
        assert line in text, line
    silent = CollectorRegistry()
    silent.register(SpecCollector("decode-0", lambda: None))
    assert "strata_spec" not in generate_latest(silent).decode()


# ---- strata workers --------------------------------------------------------------------------------------------------

def test_strata_workers_shows_method_and_acceptance():
    info = common_pb2.WorkerInfo(id="decode-0", role=common_pb2.WORKER_ROLE_DECODE,
                                 speculative=speculative_stats(make_speculation()))
    row = worker_dict(info)
    assert row["speculative"] == {"method": "ngram", "methods": ["ngram"], "num_speculative_tokens": 5,
                                  "acceptance_rate": 0.6, "mean_accepted_length": 2.5, "draft_tokens": 10,
                                  "accepted_tokens": 6, "verifies": 4, "emitted_tokens": 10, "draft_seconds": 0.25,
                                  "verify_seconds": 1.5}
    assert _speculative_cell(row["speculative"]) == "ngram 60% x2.5"
    plain = worker_dict(common_pb2.WorkerInfo(id="prefill-0", role=common_pb2.WORKER_ROLE_PREFILL))
    assert plain["speculative"] is None and _speculative_cell(None) == "-"
    fresh = worker_dict(common_pb2.WorkerInfo(speculative=common_pb2.SpeculativeStats(method="draft")))
    assert _speculative_cell(fresh["speculative"]) == "draft"
