"""`strata serve --ray` and `strata scale`: options checked before Ray is touched, the flags reach the Ray launcher,
and the parts' flags are the local launcher's (one code path), with node addresses and shipped files filled in."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from strata.cli import app
from strata.launcher import ServeConfig, worker_args_of
from strata.ray_launcher import API_KEYS, NODE_IP, Controller, RayOptions, _files


def test_ray_options_name_the_bad_field():
    with pytest.raises(ValueError, match="max_restarts must be >= -1"):
        RayOptions(max_restarts=-2)
    with pytest.raises(ValueError, match="cpus_per_worker, gpus_per_worker and router_cpus must be >= 0"):
        RayOptions(gpus_per_worker=-1)
    with pytest.raises(ValueError, match="namespace must be"):
        RayOptions(namespace="a b")


def test_address_without_ray_and_a_bad_scale_role_are_usage_errors():
    runner = CliRunner()
    result = runner.invoke(app, ["serve", "--address", "auto"])
    assert result.exit_code == 2 and "--address needs --ray" in result.output
    result = runner.invoke(app, ["scale", "middle", "2"])
    assert result.exit_code == 2 and "must be prefill or decode" in result.output


def test_ray_flags_reach_the_ray_launcher(monkeypatch):
    seen = {}

    class Recording:
        def __init__(self, config, log=None, env=None, options=None):
            seen.update(config=config, options=options, env=env)

        def start(self):
            from strata.launcher import LaunchError
            raise LaunchError("not started (test)", "router", 3)

        def stop(self):
            pass

    monkeypatch.setattr("strata.ray_launcher.RayLauncher", Recording)
    result = CliRunner().invoke(app, ["serve", "--ray", "--address", "ray://head:10001", "--ray-namespace", "blue",
                                      "--ray-gpus-per-worker", "2", "--decode", "3"])
    assert result.exit_code == 3, result.output
    assert seen["options"] == RayOptions(address="ray://head:10001", namespace="blue", gpus_per_worker=2.0)
    assert seen["config"].decode == 3
    assert "STRATA_CLUSTER_SECRET" in seen["env"]   # a fleet secret drawn for the launch, as without --ray


def test_parts_bind_their_node_and_advertise_it():
    loopback = Controller(ServeConfig(), RayOptions(), {}, {}, "node")
    host, extra = loopback._bind()
    assert host == NODE_IP and extra == ["--kv-events-endpoint", f"tcp://{NODE_IP}:*",
                                         "--kv-replay-endpoint", f"tcp://{NODE_IP}:*"]
    wildcard = Controller(ServeConfig(host="0.0.0.0"), RayOptions(), {}, {}, "node")
    host, extra = wildcard._bind()
    assert host == "0.0.0.0" and extra[-2:] == ["--advertise-host", NODE_IP]
    # the worker flags are the local launcher's, host and disk aside
    c = ServeConfig(redis_url="redis://r:6379/0", quantization="int8")
    local = worker_args_of(c, "decode", "decode-0", "/m", "reg:1", "/d")
    on_ray = worker_args_of(c, "decode", "decode-0", "/m", "reg:1", "/d", host=NODE_IP)
    assert [a for a in local if a != c.host] == [a for a in on_ray if a != NODE_IP]


def test_files_the_parts_read_travel_with_them(tmp_path):
    key = tmp_path / "kv.key"
    key.write_bytes(b"k" * 32)
    keys = tmp_path / "keys"
    keys.write_text("acme:secret-1\n")
    files = _files(ServeConfig(kv_encryption_key_file=str(key), api_keys=("secret-0",), api_keys_file=str(keys)))
    assert files[str(key)] == b"k" * 32
    assert files[API_KEYS].decode() == "default:secret-0\nacme:secret-1\n"
    assert _files(ServeConfig()) == {}


def test_a_local_cluster_gets_the_cpus_the_parts_bundles_reserve():
    from strata.ray_launcher import cpus_needed

    assert cpus_needed(ServeConfig(prefill=1, decode=2), RayOptions()) == 4.0   # router + 3 workers
    assert cpus_needed(ServeConfig(prefill=1, decode=1, expert_parallel=2), RayOptions(cpus_per_worker=2)) == 9.0
