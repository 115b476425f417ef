"""The expert-parallel options on every entry point (issue 14 item 4): the worker CLIs parse `--expert-parallel`,
`--moe-capacity-factor`, `--moe-overflow`, `--num-redundant-experts`, `--eplb-interval`, `--eplb-window` (and the
internal `--ep-rank` / `--ep-init`) into `WorkerConfig`, whose `moe_config()` is the engine's `MoEConfig`; a bad value
is refused while parsing, naming the option and what it allows; `strata serve` takes the same options and hands them
to both roles' workers; rank 0 starts each other rank with its own flags (`worker_common.ep_ranks.rank_argv`)."""
from __future__ import annotations

import dataclasses

import pytest
from typer.testing import CliRunner

from engine.config import MoEConfig
from strata.cli import app
from strata.launcher import LocalLauncher, ServeConfig, moe_args
from worker_common.cli import parse_config
from worker_common.config import WorkerConfig
from worker_common.ep_ranks import rank_argv, rank_disk_path, rank_worker_id
from tests.unit.recording_launcher import RecordingLauncher

MOE_FLAGS = ["--expert-parallel", "4", "--moe-capacity-factor", "1.25", "--moe-overflow", "next",
             "--num-redundant-experts", "2", "--eplb-interval", "50", "--eplb-window", "400"]


def one_line(text: str) -> str:
    """typer's error box, unwrapped."""
    return " ".join(text.replace("│", " ").replace("╭", " ").replace("╰", " ").replace("─", " ").split())


def make_config(**fields) -> WorkerConfig:
    return WorkerConfig(role="decode", model="-", **fields)


# ---- WorkerConfig --------------------------------------------------------------------------------------------------

def test_defaults_are_a_plain_worker_with_the_local_backend():
    config = make_config()
    assert (config.expert_parallel, config.ep_rank, config.ep_init) == (1, 0, "")
    assert config.moe_config() == MoEConfig(backend="local")


def test_moe_config_carries_every_option_and_picks_the_expert_parallel_backend():
    config = make_config(expert_parallel=2, moe_capacity_factor=1.5, moe_overflow="next", num_redundant_experts=3,
                         eplb_interval=10, eplb_window=20)
    assert config.moe_config() == MoEConfig(backend="expert_parallel", capacity_factor=1.5, overflow="next",
                                            num_redundant_experts=3, eplb_interval=10, eplb_window=20)


@pytest.mark.parametrize("fields, message", [
    ({"expert_parallel": 0}, "expert_parallel must be an integer in [1, 64], got 0"),
    ({"expert_parallel": 65}, "expert_parallel must be an integer in [1, 64], got 65"),
    ({"moe_capacity_factor": 0.0}, "moe_capacity_factor must be a number > 0 (unset: no capacity limit), got 0.0"),
    ({"moe_overflow": "spill"}, "moe_overflow must be one of drop, next, got 'spill'"),
    ({"num_redundant_experts": -1}, "num_redundant_experts must be an integer in [0, 1024] (spare expert slots per "
                                    "rank), got -1"),
    ({"eplb_interval": -5}, "eplb_interval must be an integer >= 0 (forwards between rebalances; 0 = never), got -5"),
    ({"eplb_window": 0}, "eplb_window must be an integer >= 1 (forwards of expert load kept), got 0"),
    ({"expert_parallel": 2, "ep_rank": 2}, "ep_rank must be in [0, 1] (expert_parallel=2), got 2"),
    ({"expert_parallel": 2, "ep_init": "127.0.0.1:5000"},
     "ep_init must be empty or tcp://HOST:PORT (PORT in [1, 65535]), got '127.0.0.1:5000'"),
    ({"expert_parallel": 2, "ep_init": "tcp://127.0.0.1:70000"},
     "ep_init must be empty or tcp://HOST:PORT (PORT in [1, 65535]), got 'tcp://127.0.0.1:70000'"),
    ({"ep_init": "tcp://127.0.0.1:5000"}, "ep_init is only used with expert_parallel > 1"),
    ({"expert_parallel": 2, "ep_rank": 1}, "ep_init must be set on ep_rank 1"),
    ({"expert_parallel": 2, "ep_rank": 1, "ep_init": "tcp://127.0.0.1:5000", "router_address": "127.0.0.1:1"},
     "router_address must be empty on ep_rank 1: only rank 0 registers"),
])
def test_worker_config_names_a_bad_expert_parallel_field(fields, message):
    with pytest.raises(ValueError) as info:
        make_config(**fields)
    assert message in str(info.value)


def test_a_child_rank_config_is_valid():
    config = make_config(expert_parallel=3, ep_rank=2, ep_init="tcp://127.0.0.1:29500")
    assert config.moe_config().backend == "expert_parallel"


# ---- the worker CLIs ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_worker_flags_parse_into_the_worker_config(role):
    config = parse_config(role, MOE_FLAGS)
    assert (config.expert_parallel, config.moe_capacity_factor, config.moe_overflow, config.num_redundant_experts,
            config.eplb_interval, config.eplb_window) == (4, 1.25, "next", 2, 50, 400)
    assert config.moe_config().backend == "expert_parallel"


def test_the_internal_rank_flags_parse_and_stay_out_of_the_help(capsys):
    config = parse_config("decode", ["--expert-parallel", "2", "--ep-rank", "1", "--ep-init", "tcp://127.0.0.1:29511"])
    assert (config.ep_rank, config.ep_init) == (1, "tcp://127.0.0.1:29511")
    with pytest.raises(SystemExit):
        parse_config("decode", ["--help"])
    help_text = capsys.readouterr().out
    assert "--expert-parallel" in help_text and "--moe-overflow" in help_text
    assert "--ep-rank" not in help_text and "--ep-init" not in help_text


@pytest.mark.parametrize("argv, message", [
    (["--expert-parallel", "0"], "argument --expert-parallel: must be an integer in [1, 64], got 0"),
    (["--expert-parallel", "two"], "argument --expert-parallel: must be an integer, got 'two'"),
    (["--moe-capacity-factor", "-1"], "argument --moe-capacity-factor: must be a number > 0 (unset: no capacity "
                                      "limit), got -1.0"),
    (["--moe-capacity-factor", "lots"], "argument --moe-capacity-factor: must be a number, got 'lots'"),
    (["--moe-overflow", "spill"], "argument --moe-overflow: invalid choice: 'spill' (choose from 'drop', 'next')"),
    (["--num-redundant-experts", "-2"], "argument --num-redundant-experts: must be an integer in [0, 1024]"),
    (["--eplb-interval", "-1"], "argument --eplb-interval: must be an integer >= 0"),
    (["--eplb-window", "0"], "argument --eplb-window: must be an integer >= 1"),
    (["--expert-parallel", "2", "--ep-rank", "5"], "ep_rank must be in [0, 1] (expert_parallel=2), got 5"),
])
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_bad_worker_flag_exits_2_naming_it(role, argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        parse_config(role, argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


# ---- rank 0's children ----------------------------------------------------------------------------------------------

def test_a_child_rank_gets_rank_0s_flags_and_its_own_identity(tmp_path):
    argv = ["--expert-parallel", "2", "--worker-id", "decode-0", "--router", "127.0.0.1:9", "--metrics-port", "0",
            "--disk-path", str(tmp_path / "disk"), "--port", "7000", "--moe-overflow", "next"]
    rank0 = parse_config("decode", argv)
    rank0 = dataclasses.replace(rank0, ep_init="tcp://127.0.0.1:29555")  # what rank 0 fills in
    child = parse_config("decode", rank_argv(argv, rank0, 1))
    assert (child.expert_parallel, child.ep_rank, child.ep_init) == (2, 1, "tcp://127.0.0.1:29555")
    assert (child.worker_id, child.router_address, child.metrics_port, child.port, child.host) == \
        ("decode-0-rank1", "", -1, 0, "127.0.0.1")
    assert child.disk_path == str(tmp_path / "disk") + "-rank1"
    assert child.moe_overflow == "next"                       # every other flag is rank 0's
    assert child.kv_events_endpoint == child.kv_replay_endpoint == "tcp://127.0.0.1:*"


def test_a_child_of_a_rank_0_without_events_or_disk_publishes_and_stores_nothing_there():
    rank0 = make_config(expert_parallel=2, worker_id="w", ep_init="tcp://127.0.0.1:29556", kv_events_endpoint="",
                        kv_replay_endpoint="")
    child = parse_config("decode", rank_argv(["--expert-parallel", "2"], rank0, 1))
    assert (child.kv_events_endpoint, child.kv_replay_endpoint, child.disk_path) == ("", "", "")


def test_rank_names_and_disk_paths_differ_per_rank():
    assert [rank_worker_id("prefill-0", r) for r in (1, 2)] == ["prefill-0-rank1", "prefill-0-rank2"]
    assert rank_disk_path("/data/strata/disk/", 3) == "/data/strata/disk-rank3"
    assert rank_disk_path("", 3) == ""


# ---- strata serve ---------------------------------------------------------------------------------------------------

def test_serve_flags_reach_the_serve_config(monkeypatch):
    monkeypatch.setattr("strata.launcher.LocalLauncher", RecordingLauncher)
    RecordingLauncher.configs.clear()
    out = CliRunner().invoke(app, ["serve", *MOE_FLAGS])
    assert out.exit_code == 3, out.output
    (config,) = RecordingLauncher.configs
    assert (config.expert_parallel, config.moe_capacity_factor, config.moe_overflow, config.num_redundant_experts,
            config.eplb_interval, config.eplb_window) == (4, 1.25, "next", 2, 50, 400)


def test_serve_config_file_keys_take_the_options(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("serve:\n  expert-parallel: 2\n  moe-overflow: next\n")
    config = ServeConfig.from_file(path)
    assert (config.expert_parallel, config.moe_overflow) == (2, "next")


@pytest.mark.parametrize("argv, message", [
    (["--expert-parallel", "0"], "Invalid value for '--expert-parallel': must be an integer in [1, 64], got 0"),
    (["--moe-capacity-factor", "0"], "Invalid value for '--moe-capacity-factor': must be a number > 0"),
    (["--moe-overflow", "spill"], "Invalid value for '--moe-overflow': must be one of drop, next, got 'spill'"),
    (["--eplb-window", "0"], "Invalid value for '--eplb-window': must be an integer >= 1"),
])
def test_a_bad_serve_flag_exits_2_naming_it(argv, message, monkeypatch):
    monkeypatch.setattr("strata.launcher.LocalLauncher", RecordingLauncher)
    RecordingLauncher.configs.clear()
    out = CliRunner().invoke(app, ["serve", *argv])
    assert out.exit_code == 2 and RecordingLauncher.configs == []
    assert message in one_line(out.output)


def test_serve_config_names_a_bad_option():
    with pytest.raises(ValueError, match=r"expert_parallel must be an integer in \[1, 64\], got 65"):
        ServeConfig(expert_parallel=65)


def test_both_roles_get_the_expert_parallel_flags(monkeypatch, tmp_path):
    spawned: dict[str, list[str]] = {}
    launcher = LocalLauncher(ServeConfig(expert_parallel=2, moe_capacity_factor=1.5, moe_overflow="next",
                                         num_redundant_experts=1, eplb_interval=8, eplb_window=16,
                                         data_dir=str(tmp_path)))
    monkeypatch.setattr(launcher, "_spawn", lambda name, role, module, args, ready: spawned.setdefault(name, args))
    launcher._prepare_data_dir()
    for role in ("prefill", "decode"):
        launcher._spawn_worker(role, 0, "model-folder", "")
    expected = ["--expert-parallel", "2", "--moe-capacity-factor", "1.5", "--moe-overflow", "next",
                "--num-redundant-experts", "1", "--eplb-interval", "8", "--eplb-window", "16"]
    for args in spawned.values():
        start = args.index("--expert-parallel")
        assert args[start:start + len(expected)] == expected


def test_default_serve_passes_no_expert_parallel_flags():
    assert moe_args(ServeConfig()) == []
    assert moe_args(ServeConfig(moe_overflow="next")) == ["--moe-overflow", "next"]


def test_serve_help_shows_every_flag_including_the_expert_parallel_ones():
    """`strata serve --help` renders (rich markup in a help text once broke it) and lists the MoE flags."""
    out = CliRunner().invoke(app, ["serve", "--help"], terminal_width=200)
    assert out.exit_code == 0, out.output
    for flag in ("--expert-parallel", "--num-redundant-experts", "--eplb-interval", "--moe-capacity-factor",
                 "--s3-url"):
        assert flag in out.output
    assert "BUCKET[/PREFIX]" in out.output


def test_an_ep_group_spec_pairs_gloo_with_cpu_and_nccl_with_cuda():
    from engine.moe.ep_group import EPGroupSpec
    assert EPGroupSpec(2, 1, "tcp://127.0.0.1:1", backend="nccl", device="cuda:1").device == "cuda:1"
    with pytest.raises(ValueError, match="gloo with cpu or nccl with cuda"):
        EPGroupSpec(2, 0, "tcp://127.0.0.1:1", backend="nccl")
    with pytest.raises(ValueError, match=r"ep rank must be in \[0, 1\]"):
        EPGroupSpec(2, 2, "tcp://127.0.0.1:1")
