"""Client API keys and tenants (`router.auth`), the tenant-derived cache salt (`router.validation.effective_salt`) and
the fleet secret's gRPC guard and client side (`worker_common.grpc_auth`, on a real in-process gRPC server)."""
from __future__ import annotations

from concurrent import futures
from pathlib import Path

import grpc
import pytest

from router.auth import ApiKeys, parse_keys_file
from router.validation import effective_salt
from strata.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from worker_common.grpc_auth import SECRET_ENV, attach_secret, read_cluster_secret, worker_guard

KEYS_FILE = """\
# tenants of the staging cluster
alice: sk-alice-1

bob:sk-bob:with-colon
  # an indented comment
carol:sk-carol
"""


def make_keys(*pairs: tuple[str, str]) -> ApiKeys:
    return ApiKeys(tuple(pairs))


# ------------------------------------------------------------------------------------------------ keys file

def test_keys_file_parses_tenant_key_lines_skipping_comments_and_blanks():
    assert parse_keys_file(KEYS_FILE) == [("alice", "sk-alice-1"), ("bob", "sk-bob:with-colon"),
                                          ("carol", "sk-carol")]


def test_keys_file_line_without_a_tenant_is_refused_naming_the_line_not_the_key():
    with pytest.raises(ValueError, match=r"keys\.txt line 2: must be `tenant:key`") as info:
        parse_keys_file("alice:k1\nsk-secret-without-tenant\n", "keys.txt")
    assert "sk-secret-without-tenant" not in str(info.value)


def test_load_merges_api_key_flags_as_default_tenant_and_files(tmp_path):
    path = tmp_path / "keys"
    path.write_text(KEYS_FILE)
    keys = ApiKeys.load(["k-default"], [str(path)])
    assert keys.tenants == {"default", "alice", "bob", "carol"}
    assert keys.tenant_of("Bearer k-default") == "default"


def test_load_of_a_missing_file_names_the_option(tmp_path):
    with pytest.raises(ValueError, match="api_keys_file .* cannot be read"):
        ApiKeys.load([], [str(tmp_path / "nope")])


@pytest.mark.parametrize("pairs, message", [
    ((("alice", "k"), ("bob", "k")), "given twice"),
    ((("al ice", "k"),), "api key tenant must be"),
    ((("alice", "k k"),), "no whitespace"),
    ((("", "k"),), "api key tenant must be"),
])
def test_api_keys_refuses_ambiguous_or_malformed_entries(pairs, message):
    with pytest.raises(ValueError, match=message):
        make_keys(*pairs)


def test_repr_never_shows_a_key():
    assert "sk-alice" not in repr(make_keys(("alice", "sk-alice")))


# ------------------------------------------------------------------------------------------------ tenant_of

@pytest.mark.parametrize("header, tenant", [
    ("Bearer sk-a", "alice"), ("bearer sk-b", "bob"), ("  Bearer   sk-a  ", "alice"),
    ("Bearer sk-c", None), ("Bearer sk-a-longer", None), ("Bearer sk-", None), ("sk-a", None), ("Basic sk-a", None),
    ("Bearer ", None), ("", None),
])
def test_tenant_of_names_the_tenant_of_a_known_bearer_key_only(header, tenant):
    keys = make_keys(("alice", "sk-a"), ("bob", "sk-b"))
    assert keys.tenant_of(header) == tenant


def test_refusal_explains_a_missing_and_a_wrong_key():
    keys = make_keys(("alice", "sk-a"))
    assert "wants an API key" in keys.refusal("")
    assert "not valid" in keys.refusal("Bearer nope")
    assert keys.refusal("Bearer sk-a") is None
    assert ApiKeys().refusal("") is None  # keys off: everyone is let in


def test_identity_is_the_tenant_with_keys_and_the_raw_header_without():
    keys = make_keys(("alice", "sk-a"), ("alice2", "sk-a2"))
    assert keys.identity("Bearer sk-a") == "tenant:alice"
    assert ApiKeys().identity("Bearer x") == "token:Bearer x"
    assert ApiKeys().identity("") == "anonymous"


# ------------------------------------------------------------------------------------------------ cache salt

def test_isolated_tenants_get_their_own_salt_without_sending_one():
    alice, bob = "tenant:alice", "tenant:bob"
    assert effective_salt("", alice, isolated=True) != ""
    assert effective_salt("", alice, isolated=True) == effective_salt("", alice, isolated=True)
    assert effective_salt("", alice, isolated=True) != effective_salt("", bob, isolated=True)


def test_a_tenant_cannot_reach_another_tenants_namespace_with_any_salt():
    target = effective_salt("", "tenant:alice", isolated=True)
    tries = ["", "alice", "tenant:alice", "tenant:alice\0", "\0", "x"]
    assert target not in {effective_salt(salt, "tenant:bob", isolated=True) for salt in tries}


def test_without_isolation_no_salt_is_the_shared_public_namespace():
    assert effective_salt("", "token:Bearer x") == ""
    assert effective_salt("s", "token:Bearer x") != effective_salt("s", "anonymous")


# ------------------------------------------------------------------------------------------------ fleet secret

def test_cluster_secret_comes_from_the_file_first_then_the_environment(tmp_path):
    path = tmp_path / "secret"
    path.write_text("s3cr3t  \nignored\n")
    assert read_cluster_secret(str(path), {SECRET_ENV: "from-env"}) == "s3cr3t"
    assert read_cluster_secret(None, {SECRET_ENV: " from-env\n"}) == "from-env"
    assert read_cluster_secret(None, {}) == ""


def test_cluster_secret_file_that_is_empty_or_missing_is_refused(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="cluster_secret_file .* empty"):
        read_cluster_secret(str(empty), {})
    with pytest.raises(ValueError, match="cluster_secret_file .* cannot be read"):
        read_cluster_secret(str(tmp_path / "missing"), {})


class AnsweringWorker(worker_pb2_grpc.WorkerServicer):
    """Answers Health, Stats and (streamed) Decode: what the guard lets through reaches it."""

    def Health(self, request, context):
        return worker_pb2.HealthResponse(worker_id="w")

    def Stats(self, request, context):
        return worker_pb2.StatsResponse(worker_id="w")

    def Decode(self, request, context):
        yield worker_pb2.TokenChunk(request_id=request.request_id, token_ids=[1])


@pytest.fixture
def guarded_worker():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=worker_guard("fleet-secret"))
    worker_pb2_grpc.add_WorkerServicer_to_server(AnsweringWorker(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channels: list[grpc.Channel] = []

    def stub(secret: str = "") -> worker_pb2_grpc.WorkerStub:
        channels.append(grpc.insecure_channel(f"127.0.0.1:{port}"))
        return worker_pb2_grpc.WorkerStub(attach_secret(channels[-1], secret))
    yield stub
    for channel in channels:
        channel.close()
    server.stop(0)


@pytest.mark.parametrize("secret", ["", "wrong-secret"])
def test_worker_guard_refuses_rpcs_without_the_secret_but_answers_health(guarded_worker, secret):
    stub = guarded_worker(secret)
    assert stub.Health(worker_pb2.HealthRequest(), timeout=10).worker_id == "w"
    with pytest.raises(grpc.RpcError) as info:
        stub.Stats(worker_pb2.StatsRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and "fleet secret" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Decode(worker_pb2.DecodeRequest(request_id="r"), timeout=10))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_worker_guard_lets_the_secret_through_on_unary_and_streamed_calls(guarded_worker):
    stub = guarded_worker("fleet-secret")
    assert stub.Stats(worker_pb2.StatsRequest(), timeout=10).worker_id == "w"
    assert stub.Stats.future(worker_pb2.StatsRequest(), timeout=10).result().worker_id == "w"
    chunks = list(stub.Decode(worker_pb2.DecodeRequest(request_id="r", sampling=common_pb2.SamplingParams()),
                              timeout=10))
    assert [list(c.token_ids) for c in chunks] == [[1]]


def test_no_secret_means_no_guard():
    assert worker_guard("") == []


# ------------------------------------------------------------------------------------------------ strata serve

def test_serve_hands_api_keys_to_the_router_in_a_private_file_removed_on_stop(tmp_path):
    import io
    import stat

    from strata.launcher import LocalLauncher, ServeConfig

    (tmp_path / "keys").write_text("alice:sk-a\n")
    launcher = LocalLauncher(ServeConfig(api_keys=("k1", "k2"), api_keys_file=str(tmp_path / "keys")),
                             log=io.StringIO())
    args = launcher._key_args()
    assert args[:2] == ["--api-keys-file", str(tmp_path / "keys")] and args[2] == "--api-keys-file"
    private = Path(args[3])
    assert private.read_text() == "default:k1\ndefault:k2\n" and "k1" not in " ".join(args)
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert launcher.config.client_keys().tenants == {"default", "alice"}
    launcher.stop()
    assert not private.exists()


def test_serve_draws_a_fresh_fleet_secret_unless_one_is_given(tmp_path, monkeypatch):
    from strata.cli_serve import fleet_secret_env
    from strata.launcher import ServeConfig

    monkeypatch.delenv(SECRET_ENV, raising=False)
    first, second = fleet_secret_env(ServeConfig()), fleet_secret_env(ServeConfig())
    assert len(first[SECRET_ENV]) == 64 and first != second
    (tmp_path / "secret").write_text("given\n")
    assert fleet_secret_env(ServeConfig(cluster_secret_file=str(tmp_path / "secret"))) == {}
    monkeypatch.setenv(SECRET_ENV, "from-the-environment")
    assert fleet_secret_env(ServeConfig()) == {}


def test_serve_config_refuses_a_bad_keys_file_before_anything_starts(tmp_path):
    from strata.launcher import ServeConfig

    (tmp_path / "keys").write_text("no-colon-here\n")
    with pytest.raises(ValueError, match="line 1: must be `tenant:key`"):
        ServeConfig(api_keys_file=str(tmp_path / "keys"))


def test_serve_access_flags_reach_the_config_and_a_drawn_secret_the_environment(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from strata.cli import app
    from tests.unit.recording_launcher import RecordingLauncher

    monkeypatch.setattr("strata.launcher.LocalLauncher", RecordingLauncher)
    monkeypatch.delenv(SECRET_ENV, raising=False)
    RecordingLauncher.configs.clear()
    RecordingLauncher.envs.clear()
    (tmp_path / "keys").write_text("alice:sk-a\n")
    out = CliRunner().invoke(app, ["serve", "--api-key", "k1", "--api-key", "k2",
                                   "--api-keys-file", str(tmp_path / "keys")])
    assert out.exit_code == 3, out.output
    (config,) = RecordingLauncher.configs
    assert (config.api_keys, config.api_keys_file) == (("k1", "k2"), str(tmp_path / "keys"))
    assert len(RecordingLauncher.envs[0][SECRET_ENV]) == 64
