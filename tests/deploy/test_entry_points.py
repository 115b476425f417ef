"""The Ray cluster file is one `ray up` accepts, and every `strata ...` command that the README, the Ray cluster file
and the Docker image's default start parses with the real command line (no unknown option, no bad value): the
commands users copy start the same entry points that the tests start."""
from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path

import pytest
import typer
import yaml

from strata.cli import app

try:   # typer >= 0.20 carries its own copy of click
    from typer._click.exceptions import UsageError
except ImportError:
    from click.exceptions import UsageError

SUBCOMMANDS = ("serve", "scale", "generate", "cache", "workers")
ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "deploy" / "ray" / "cluster.yaml"
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"


def code_lines(text: str, fenced_only: bool) -> list[str]:
    """The lines of `text` that are code: inside ``` fences (a Markdown file), or all of them (YAML, whose comments
    show the commands)."""
    if not fenced_only:
        return [line.lstrip("# ").rstrip() for line in text.splitlines()]
    lines, inside = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
        elif inside:
            lines.append(line)
    return lines


def strata_commands(lines: list[str]) -> list[list[str]]:
    """Every `strata <command> ...` on those lines, as words: bare (up to a shell operator or comment) or quoted
    (`ray exec ... 'strata serve ...'`)."""
    found = []
    for line in lines:
        try:
            words = shlex.split(line.rstrip("\\"), comments=True)
        except ValueError:
            continue
        for i, word in enumerate(words):
            if word.startswith("strata ") and word.split()[1] in SUBCOMMANDS:
                found.append(shlex.split(word))
            elif word == "strata" and i + 1 < len(words) and words[i + 1] in SUBCOMMANDS:
                rest = words[i:]
                end = next((j for j, w in enumerate(rest) if w in ("|", "&&", ";", "||")), len(rest))
                found.append(rest[:end])
    return found


def parse(command: str | list[str]) -> None:
    """Parse `command` with the real `strata` CLI, running nothing: UsageError for an unknown option or bad value."""
    words = (shlex.split(command) if isinstance(command, str) else list(command))[1:]
    group = typer.main.get_command(app)
    with group.make_context("strata", list(words), resilient_parsing=False) as ctx:
        name, sub, rest = group.resolve_command(ctx, words)
        while hasattr(sub, "resolve_command"):   # a group: `strata cache stats`
            sub_ctx = sub.make_context(name, rest, parent=ctx)
            name, sub, rest = sub.resolve_command(sub_ctx, rest)
            ctx = sub_ctx
        sub.make_context(name, rest, parent=ctx)


def test_the_ray_cluster_file_is_one_ray_up_accepts():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load(CLUSTER.read_text())
    validate_config(config)
    validate_config(prepare_config(copy.deepcopy(config)))   # what `ray up` runs before launching anything
    assert config["docker"]["image"] == "strata:cpu"         # the image the README builds from the Dockerfile
    with pytest.raises(Exception, match="max_workers"):
        validate_config({**config, "max_workers": "many"})


@pytest.mark.parametrize("source", ["README.md", "deploy/ray/cluster.yaml"])
def test_every_strata_command_shown_parses(source):
    commands = strata_commands(code_lines((ROOT / source).read_text(), fenced_only=source.endswith(".md")))
    assert any(c[:3] == ["strata", "serve", "--ray"] for c in commands), commands
    for command in commands:
        try:
            parse(command)
        except UsageError as exc:
            raise AssertionError(f"{source}: `{shlex.join(command)}` does not parse: {exc}") from None


def test_the_image_default_command_parses():
    text = DOCKERFILE.read_text()
    entry = re.search(r'^ENTRYPOINT \[(.*)\]$', text, re.M).group(1)
    cmd = re.search(r'^CMD \[(.*)\]$', text, re.M).group(1)
    words = [w.strip().strip('"') for w in (entry + "," + cmd).split(",")]
    assert words[0] == "strata"
    parse(" ".join(words))


def test_a_wrong_option_does_not_parse():
    with pytest.raises(UsageError):
        parse("strata serve --ray --adress auto")
    with pytest.raises(UsageError):
        parse("strata scale decode two")
