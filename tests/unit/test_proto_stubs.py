"""The strata.v1 contracts: committed stubs match the .proto files, import with the installed grpcio/protobuf, and
the main messages survive a wire round trip with the field semantics the docs promise (presence, oneofs)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2

from strata.v1 import (
    common_pb2,
    router_pb2,
    router_pb2_grpc,
    strata_pb2,
    strata_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

ROOT = Path(__file__).resolve().parents[2]
GEN_SCRIPT = ROOT / "scripts" / "gen_proto.py"
HASH = bytes(range(16))


def load_gen_proto():
    spec = importlib.util.spec_from_file_location("gen_proto", GEN_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def round_trip(message):
    """Serialize and parse back; the copy must equal the original."""
    copy = type(message).FromString(message.SerializeToString())
    assert copy == message
    return copy


def make_location(i: int = 0) -> common_pb2.BlockLocation:
    return common_pb2.BlockLocation(worker_id="prefill-0", backend="tcp", agent_address="tcp://127.0.0.1:5601",
                                    region_id="host-pool", offset=i * 65536, length=65536,
                                    transfer_lease_id=2**40 + i)


def make_handle(num_blocks: int = 3) -> common_pb2.KvHandle:
    return common_pb2.KvHandle(
        namespace_fingerprint=HASH, block_size=16,
        block_hashes=[bytes([i]) * 16 for i in range(num_blocks)], num_tokens=num_blocks * 16 + 5,
        blocks=[make_location(i) for i in range(num_blocks)], lease_id="lease-1",
        lease_deadline_unix_ms=1_780_000_000_000, lease_worker_address="127.0.0.1:7001",
        tail=make_location(num_blocks), tail_tokens=5)


def make_sampling(**overrides) -> common_pb2.SamplingParams:
    fields = dict(max_tokens=32, temperature=0.7, top_k=40, top_p=0.9, seed=1234, stop=["\n\n"],
                  stop_token_ids=[2], ignore_eos=False)
    fields.update(overrides)
    return common_pb2.SamplingParams(**fields)


# --- generated stubs are fresh -----------------------------------------------------------------------------------

def test_committed_stubs_are_not_stale():
    done = subprocess.run([sys.executable, str(GEN_SCRIPT), "--check"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, f"stale stubs; run `python scripts/gen_proto.py`:\n{done.stderr}"


def test_check_names_the_stale_file_when_a_stub_differs(tmp_path):
    gen = load_gen_proto()
    fresh = gen.generate(tmp_path)
    stale = tmp_path / "strata" / "v1" / "common_pb2.py"
    stale.write_text(stale.read_text() + "# edited by hand\n")
    assert gen.stale_files(tmp_path, fresh) == ["strata/v1/common_pb2.py: differs from its .proto"]


def test_generation_is_reproducible(tmp_path):
    gen = load_gen_proto()
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir(), second.mkdir()
    files = gen.generate(first)
    assert files == gen.generate(second)
    assert {f.name for f in files} >= {"strata_pb2.py", "strata_pb2_grpc.py", "worker_pb2.py", "router_pb2.py"}
    for rel in files:
        assert (first / rel).read_bytes() == (second / rel).read_bytes(), rel


# --- the services exist as documented ----------------------------------------------------------------------------

@pytest.mark.parametrize("pb2, service, methods", [
    (strata_pb2, "Strata", {"Generate", "Abort", "ListModels", "GetCacheStats", "ListWorkers", "EvictCache",
                            "FlushCache"}),
    (worker_pb2, "Worker", {"Prefill", "PrefillStream", "Decode", "Generate", "ReleaseKv", "Abort", "Health", "Stats",
                            "EvictCache", "FlushCache"}),
    (router_pb2, "Registry", {"RegisterWorker", "Heartbeat", "Drain", "Deregister"}),
])
def test_service_has_its_methods(pb2, service, methods):
    descriptor = pb2.DESCRIPTOR.services_by_name[service]
    assert pb2.DESCRIPTOR.package == "strata.v1"
    assert set(descriptor.methods_by_name) == methods


def test_every_rpc_has_a_contract_comment(tmp_path):
    """The .proto comments are the contract docs: an RPC without one is a contract nobody wrote down."""
    gen = load_gen_proto()
    out = tmp_path / "set.pb"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-Iproto", f"--descriptor_set_out={out}",
                    "--include_source_info", *gen.proto_files()], cwd=ROOT, check=True)
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    undocumented = []
    for f in files:
        comments = {tuple(loc.path): loc.leading_comments.strip() for loc in f.source_code_info.location}
        for si, service in enumerate(f.service):
            # Path numbers from descriptor.proto: FileDescriptorProto.service = 6, ServiceDescriptorProto.method = 2.
            if not comments.get((6, si)):
                undocumented.append(service.name)
            undocumented += [f"{service.name}.{m.name}" for mi, m in enumerate(service.method)
                             if not comments.get((6, si, 2, mi))]
    assert undocumented == []


def test_streaming_rpcs_are_server_streaming():
    def streams(pb2, service, method):
        m = pb2.DESCRIPTOR.services_by_name[service].methods_by_name[method]
        return (m.client_streaming, m.server_streaming)

    assert streams(strata_pb2, "Strata", "Generate") == (False, True)
    assert streams(worker_pb2, "Worker", "Decode") == (False, True)
    assert streams(worker_pb2, "Worker", "Generate") == (False, True)
    assert streams(worker_pb2, "Worker", "Prefill") == (False, False)


def reserved_numbers(message_cls) -> set[int]:
    proto = descriptor_pb2.DescriptorProto()
    message_cls.DESCRIPTOR.CopyToProto(proto)
    return {n for r in proto.reserved_range for n in range(r.start, r.end)}


def test_future_fields_are_reserved():
    """Speculative decoding and quantization get their field numbers now, so nothing else takes them. 20, the
    first of speculative decoding's, is its `speculative` field."""
    assert set(range(21, 40)) <= reserved_numbers(common_pb2.SamplingParams)
    assert common_pb2.SamplingParams.DESCRIPTOR.fields_by_name["speculative"].number == 20
    assert set(range(16, 32)) <= reserved_numbers(common_pb2.KvHandle)
    assert set(range(16, 20)) <= reserved_numbers(strata_pb2.GenerateResponse)
    assert set(range(16, 20)) <= reserved_numbers(worker_pb2.TokenChunk)


# --- messages round-trip with the documented semantics -----------------------------------------------------------

def test_sampling_params_seed_zero_is_present_and_unset_is_absent():
    seeded = round_trip(make_sampling(seed=0))
    assert seeded.HasField("seed") and seeded.seed == 0
    unseeded = round_trip(common_pb2.SamplingParams(max_tokens=8))
    assert not unseeded.HasField("seed")
    assert not unseeded.HasField("top_p") and unseeded.HasField("max_tokens")


def test_sampling_params_keep_double_precision():
    copy = round_trip(make_sampling(temperature=0.9, top_p=0.95))
    assert copy.temperature == 0.9 and copy.top_p == 0.95


def test_generate_request_prompt_is_a_oneof_of_text_and_token_ids():
    by_text = round_trip(strata_pb2.GenerateRequest(model="tiny", text="def fibonacci(n):", sampling=make_sampling(),
                                                    request_id="r1", cache_salt="tenant-a",
                                                    stream_options=strata_pb2.StreamOptions(include_metrics=True)))
    assert by_text.WhichOneof("prompt") == "text"
    by_ids = strata_pb2.GenerateRequest(model="tiny", token_ids=strata_pb2.TokenIds(ids=[1, 2, 2**32 - 1]))
    by_ids.text = "now text"  # setting one member of a oneof clears the other
    assert by_ids.WhichOneof("prompt") == "text" and not by_ids.HasField("token_ids")
    by_ids.token_ids.ids.extend([5, 6])
    assert round_trip(by_ids).token_ids.ids == [5, 6]


def test_generate_response_last_chunk_carries_finish_usage_and_metrics():
    last = round_trip(strata_pb2.GenerateResponse(
        request_id="r1", token_ids=[42], text_delta="ok", finish_reason=common_pb2.FINISH_REASON_STOP,
        usage=common_pb2.Usage(prompt_tokens=37, completion_tokens=9, cached_tokens=32), stop_str="\n\n",
        metrics=strata_pb2.RequestMetrics(prefill_worker_id="p0", decode_worker_id="d0", disaggregated=True,
                                          timings=common_pb2.Timings(queue_ms=0.5, prefill_ms=12.0, ttft_ms=15.25),
                                          blocks_transferred=2)))
    assert last.WhichOneof("stop_reason") == "stop_str"
    assert last.usage.cached_tokens == 32 and last.metrics.timings.ttft_ms == 15.25
    middle = round_trip(strata_pb2.GenerateResponse(request_id="r1", token_ids=[7, 8]))
    assert middle.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED and not middle.HasField("usage")


def test_kv_handle_round_trips_block_locations_and_lease():
    handle = round_trip(make_handle(3))
    assert len(handle.blocks) == len(handle.block_hashes) == 3
    assert all(len(h) == 16 for h in handle.block_hashes)
    assert handle.num_tokens == len(handle.block_hashes) * handle.block_size + handle.tail_tokens
    assert handle.blocks[2].offset == 2 * 65536 and handle.HasField("tail")
    assert handle.blocks[1].HasField("transfer_lease_id") and not common_pb2.BlockLocation().HasField(
        "transfer_lease_id")
    assert not round_trip(common_pb2.KvHandle()).HasField("tail")  # the empty handle is valid: recompute all


def test_prefill_and_decode_messages_round_trip():
    prefill = round_trip(worker_pb2.PrefillRequest(request_id="r1", token_ids=list(range(53)),
                                                   sampling=make_sampling(), cache_salt="s", lease_ms=5000))
    answer = round_trip(worker_pb2.PrefillResponse(
        request_id="r1", first_token_id=99, first_text_delta=" def", kv=make_handle(3), cached_tokens=16,
        timings=common_pb2.Timings(queue_ms=1.0, prefill_ms=20.0, store_ms=2.5), worker_id="prefill-0"))
    decode = round_trip(worker_pb2.DecodeRequest(request_id="r1", token_ids=prefill.token_ids,
                                                 first_token_id=answer.first_token_id, kv=answer.kv,
                                                 sampling=prefill.sampling, cache_salt="s", cached_tokens=16))
    assert decode.kv == answer.kv and decode.sampling.seed == 1234
    chunk = round_trip(worker_pb2.TokenChunk(
        request_id="r1", token_ids=[3], finish_reason=common_pb2.FINISH_REASON_LENGTH,
        usage=common_pb2.Usage(prompt_tokens=53, completion_tokens=32), blocks_transferred=1, blocks_recomputed=2,
        kv_fallback_reason="lease expired"))
    assert chunk.blocks_transferred + chunk.blocks_from_store + chunk.blocks_recomputed == len(decode.kv.block_hashes)
    assert round_trip(worker_pb2.ReleaseKvRequest(lease_id="lease-1")).lease_id == "lease-1"


def test_cache_stats_and_worker_info_round_trip():
    tier = common_pb2.CacheTierStats(tier="redis", shared=True, capacity_bytes=2**34, used_bytes=2**20, blocks=16,
                                     hit_blocks=10, miss_blocks=2, hit_tokens=160, miss_tokens=32, bytes_read=4096,
                                     bytes_written=8192, evictions=1, promotions=3, demotions=4, errors=5,
                                     checksum_failures=6, get_latency_p50_ms=0.4, get_latency_p99_ms=2.5,
                                     healthy=True)
    stats = round_trip(strata_pb2.GetCacheStatsResponse(workers=[
        common_pb2.WorkerCacheStats(worker_id="decode-0", tiers=[tier], collected_at_unix_ms=1),
        common_pb2.WorkerCacheStats(worker_id="decode-1", error="deadline exceeded")]))
    assert stats.workers[0].tiers[0].checksum_failures == 6 and stats.workers[1].error
    info = common_pb2.WorkerInfo(
        id="decode-0", role=common_pb2.WORKER_ROLE_DECODE, address="127.0.0.1:7002",
        state=common_pb2.WORKER_STATE_DRAINING,
        load=common_pb2.WorkerLoad(running=3, waiting=1, kv_usage=0.25, running_tokens=900, backlog_s=0.2),
        model=common_pb2.ModelInfo(id="tiny", max_model_len=4096,
                                   kv=common_pb2.KvSpec(model_fingerprint="m", kv_layout="l", kv_dtype="float32",
                                                        block_size=16)),
        kv_events_endpoint="tcp://127.0.0.1:5557", transfer_backends=["shm", "tcp"], tiers=["device", "host"])
    assert round_trip(strata_pb2.ListWorkersResponse(workers=[info])).workers[0] == info
    register = round_trip(router_pb2.RegisterWorkerRequest(worker=info))
    assert register.worker.model.kv.block_size == 16
    beat = round_trip(router_pb2.HeartbeatRequest(worker_id="decode-0", load=info.load, kv_event_batches_published=2**40))
    assert beat.kv_event_batches_published == 2**40


def test_cache_admin_messages_round_trip():
    evict = round_trip(common_pb2.EvictCacheRequest(tier="host", block_hashes=[HASH], demote=True))
    assert evict.block_hashes == [HASH] and evict.bytes == 0
    flush = round_trip(common_pb2.FlushCacheResponse(results=[
        common_pb2.CacheAdminResult(worker_id="p0", tier="disk", blocks_removed=5, bytes_freed=5 * 65536)]))
    assert flush.results[0].bytes_freed == 327680


# --- the stubs talk over a real socket ---------------------------------------------------------------------------

class EchoStrata(strata_pb2_grpc.StrataServicer):
    """Streams the prompt's token ids back one per chunk; rejects an empty prompt the documented way."""

    def Generate(self, request, context):
        ids = list(request.token_ids.ids)
        if not ids:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt must not be empty")
        for token in ids:
            yield strata_pb2.GenerateResponse(request_id=request.request_id, token_ids=[token])
        yield strata_pb2.GenerateResponse(request_id=request.request_id, finish_reason=common_pb2.FINISH_REASON_LENGTH,
                                          usage=common_pb2.Usage(prompt_tokens=len(ids), completion_tokens=len(ids)))


@pytest.fixture
def strata_channel():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    strata_pb2_grpc.add_StrataServicer_to_server(EchoStrata(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        server.stop(grace=None)


def test_generate_streams_over_a_real_channel(strata_channel):
    stub = strata_pb2_grpc.StrataStub(strata_channel)
    request = strata_pb2.GenerateRequest(token_ids=strata_pb2.TokenIds(ids=[5, 6, 7]), request_id="r9")
    chunks = list(stub.Generate(request, timeout=10))
    assert [list(c.token_ids) for c in chunks] == [[5], [6], [7], []]
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH and chunks[-1].usage.prompt_tokens == 3


def test_generate_error_reaches_the_client_as_its_status(strata_channel):
    stub = strata_pb2_grpc.StrataStub(strata_channel)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(strata_pb2.GenerateRequest(), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in err.value.details()


def test_worker_and_registry_stubs_build_on_a_channel():
    with grpc.insecure_channel("127.0.0.1:1") as channel:
        assert callable(worker_pb2_grpc.WorkerStub(channel).Prefill)
        assert callable(router_pb2_grpc.RegistryStub(channel).Heartbeat)
    assert hasattr(worker_pb2_grpc, "add_WorkerServicer_to_server")
    assert hasattr(router_pb2_grpc, "add_RegistryServicer_to_server")
