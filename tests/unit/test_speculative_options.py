"""The speculative-decoding options on every entry point (issue 13 item 5): `strata serve`, `strata generate` and the
worker CLIs parse `--speculative`, `--num-speculative-tokens`, `--speculative-model` and
`--no-speculative-adaptive` into their configs; a bad value is refused while parsing, naming the option and what it
allows, before any model loads; `strata serve` hands the options to its decode workers only."""
from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from strata.cli import app
from strata.launcher import LocalLauncher, ServeConfig, speculative_args
from strata.paths import REPO_ROOT, bundled_model
from strata.speculative_options import speculative_config, worker_args
from worker_common.cli import parse_config
from worker_common.config import WorkerConfig
from tests.unit.recording_launcher import RecordingLauncher

DRAFT = bundled_model("strata-draft-tiny")


def one_line(text: str) -> str:
    """typer's error box, unwrapped."""
    return " ".join(text.replace("│", " ").replace("╭", " ").replace("╰", " ").replace("─", " ").split())


# ---- the worker CLIs -----------------------------------------------------------------------------------------------

def test_worker_flags_parse_into_the_worker_config():
    config = parse_config("decode", ["--speculative", "draft", "--num-speculative-tokens", "6",
                                     "--speculative-model", DRAFT, "--no-speculative-adaptive"])
    assert (config.speculative, config.num_speculative_tokens, config.speculative_model,
            config.speculative_adaptive) == ("draft", 6, DRAFT, False)
    spec = config.speculative_config()
    assert (spec.method, spec.num_speculative_tokens, spec.draft_model, spec.adaptive) == ("draft", 6, DRAFT, False)


def test_worker_speculation_is_off_by_default():
    config = parse_config("decode", [])
    assert config.speculative is None and config.num_speculative_tokens == 4 and config.speculative_adaptive
    assert not config.speculative_config().enabled


@pytest.mark.parametrize("argv, message", [
    (["--speculative", "medusa"], "argument --speculative: invalid choice: 'medusa' (choose from 'ngram', 'draft', "
                                  "'eagle')"),
    (["--num-speculative-tokens", "17"], "argument --num-speculative-tokens: must be an integer in [1, 16], got 17"),
    (["--num-speculative-tokens", "two"], "argument --num-speculative-tokens: must be an integer, got 'two'"),
    (["--speculative", "ngram", "--speculative-model", DRAFT],
     "argument --speculative-model: only used with --speculative draft or eagle"),
    (["--speculative", "draft", "--speculative-model", "/no/such/draft"],
     "argument --speculative-model: must be a local folder or a bundled model name, got '/no/such/draft'"),
])
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_bad_worker_flag_exits_2_naming_it(role, argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        parse_config(role, argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_missing_bundled_eagle_head_is_named_while_parsing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("STRATA_MODELS", str(tmp_path))
    with pytest.raises(SystemExit):
        parse_config("decode", ["--model", str(REPO_ROOT / "models" / "strata-moe-tiny"), "--speculative", "eagle"])
    err = capsys.readouterr().err
    assert "--speculative-model: speculative 'eagle' defaults to the bundled EAGLE head 'strata-eagle-tiny', which " \
           "is not installed" in err


@pytest.mark.parametrize("fields, message", [
    ({"speculative": "medusa"}, "speculative must be one of ngram, draft, eagle, got 'medusa'"),
    ({"speculative": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer in [1, 16]"),
    ({"speculative": "ngram", "speculative_model": DRAFT}, "speculative_model is only used with speculative 'draft'"),
])
def test_worker_config_names_a_bad_speculative_field(fields, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        WorkerConfig(role="decode", model="-", **fields)


def test_a_prefill_worker_takes_the_flags_and_never_builds_a_drafter():
    from worker_common.engine_setup import _speculative_of
    prefill = WorkerConfig(role="prefill", model="-", speculative="ngram")
    decode = WorkerConfig(role="decode", model="-", speculative="ngram", num_speculative_tokens=3)
    assert _speculative_of(prefill) is None
    assert _speculative_of(decode) == speculative_config("ngram", 3)


# ---- strata serve ---------------------------------------------------------------------------------------------------

def test_serve_flags_reach_the_serve_config(monkeypatch):
    monkeypatch.setattr("strata.launcher.LocalLauncher", RecordingLauncher)
    RecordingLauncher.configs.clear()
    out = CliRunner().invoke(app, ["serve", "--speculative", "draft", "--num-speculative-tokens", "5",
                                   "--speculative-model", DRAFT, "--no-speculative-adaptive"])
    assert out.exit_code == 3, out.output
    (config,) = RecordingLauncher.configs
    assert (config.speculative, config.num_speculative_tokens, config.speculative_model,
            config.speculative_adaptive) == ("draft", 5, DRAFT, False)


def test_serve_config_file_keys_take_the_options(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("serve:\n  speculative: ngram\n  num-speculative-tokens: 3\n")
    config = ServeConfig.from_file(path)
    assert (config.speculative, config.num_speculative_tokens) == ("ngram", 3)


@pytest.mark.parametrize("argv, message", [
    (["--speculative", "medusa"], "Invalid value for '--speculative': must be one of ngram, draft, eagle, got "
                                  "'medusa'"),
    (["--num-speculative-tokens", "0"], "Invalid value for '--num-speculative-tokens': must be an integer in "
                                        "[1, 16], got 0"),
])
@pytest.mark.parametrize("command", ["serve", "generate"])
def test_a_bad_flag_of_serve_or_generate_exits_2_naming_it(command, argv, message):
    args = [command, *(["hello"] if command == "generate" else []), *argv]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 2
    assert message in one_line(out.output)


def test_serve_refuses_a_missing_draft_folder_before_starting_anything(monkeypatch):
    monkeypatch.setattr("strata.launcher.LocalLauncher", RecordingLauncher)
    RecordingLauncher.configs.clear()
    out = CliRunner().invoke(app, ["serve", "--speculative", "draft", "--speculative-model", "/no/such/draft"])
    assert out.exit_code == 2 and RecordingLauncher.configs == []
    assert "error: speculative_model must be a local folder or a bundled model name, got '/no/such/draft'" in out.output


def test_only_decode_workers_get_the_speculative_flags(monkeypatch, tmp_path):
    spawned: dict[str, list[str]] = {}
    launcher = LocalLauncher(ServeConfig(speculative="draft", num_speculative_tokens=3, speculative_model=DRAFT,
                                         speculative_adaptive=False, data_dir=str(tmp_path)))
    monkeypatch.setattr(launcher, "_spawn", lambda name, role, module, args, ready: spawned.setdefault(name, args))
    launcher._prepare_data_dir()
    for role in ("prefill", "decode"):
        launcher._spawn_worker(role, 0, "model-folder", "")
    decode, prefill = spawned["decode-0"], spawned["prefill-0"]
    assert "--speculative" not in prefill and "--num-speculative-tokens" not in prefill
    start = decode.index("--speculative")
    assert decode[start:start + 7] == ["--speculative", "draft", "--num-speculative-tokens", "3",
                                       "--speculative-model", str(Path(DRAFT).resolve()), "--no-speculative-adaptive"]


def test_speculative_args_are_empty_when_off_and_resolve_the_drafter_folder():
    assert speculative_args(ServeConfig()) == [] and worker_args(None, 7) == []
    assert speculative_args(ServeConfig(speculative="ngram")) == ["--speculative", "ngram",
                                                                  "--num-speculative-tokens", "4"]
    assert speculative_args(ServeConfig(speculative="draft", speculative_model="strata-draft-tiny"))[-1] == \
        str(Path(DRAFT).resolve())


@pytest.mark.slow
def test_generate_with_ngram_speculation_prints_the_plain_greedy_text():
    """`strata generate` runs the bundled model in-process: speculation changes the speed, never the greedy text."""
    args = ["generate", "x = [1, 2, 3]\nx = [1, 2, 3]\nx = [", "--max-tokens", "16", "--temperature", "0",
            "--repetition-penalty", "1"]
    plain = CliRunner().invoke(app, args)
    spec = CliRunner().invoke(app, [*args, "--speculative", "ngram", "--num-speculative-tokens", "3"])
    assert plain.exit_code == spec.exit_code == 0, plain.output + spec.output
    assert spec.stdout == plain.stdout and len(plain.stdout) > len(args[1])
