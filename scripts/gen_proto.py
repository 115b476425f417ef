"""Generate the Python stubs in `strata/v1/` from `proto/strata/v1/*.proto` (the .proto files are the source of truth).

    python scripts/gen_proto.py           # regenerate the committed stubs in place
    python scripts/gen_proto.py --check   # exit 1, naming each stale file, if the committed stubs differ

protoc runs with `-Iproto`, so the generated modules import each other as `strata.v1.*`. Output is byte-for-byte
reproducible for a given grpcio-tools version (pinned in pyproject.toml, because its stubs refuse an older runtime):
the files are passed in sorted order and nothing time- or path-dependent is written.
"""
from __future__ import annotations

import argparse
import filecmp
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = "proto"
PACKAGE = Path("strata") / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[str]:
    """The .proto files as protoc sees them from the repo root, sorted so that every run passes the same list."""
    files = sorted((ROOT / PROTO_ROOT / PACKAGE).glob("*.proto"))
    if not files:
        raise SystemExit(f"no .proto files under {PROTO_ROOT}/{PACKAGE.as_posix()}")
    return [f.relative_to(ROOT).as_posix() for f in files]


def _well_known_include() -> str:
    import grpc_tools

    return str(Path(grpc_tools.__file__).parent / "_proto")


def generate(out_dir: Path) -> list[Path]:
    """Run protoc into `out_dir`; return the generated files relative to it (under strata/v1/)."""
    cmd = [
        sys.executable, "-m", "grpc_tools.protoc",
        f"-I{PROTO_ROOT}", f"-I{_well_known_include()}",
        f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}",
        *proto_files(),
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"protoc failed ({done.returncode}):\n{done.stderr}")
    return sorted(p.relative_to(out_dir) for p in (out_dir / PACKAGE).iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def committed() -> list[Path]:
    """Generated-looking files now in strata/v1/ (the hand-written __init__.py is not one)."""
    pkg = ROOT / PACKAGE
    if not pkg.is_dir():
        return []
    return sorted(p.relative_to(ROOT) for p in pkg.iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def stale_files(fresh_dir: Path, fresh: list[Path]) -> list[str]:
    """One line per committed stub that differs from, is missing from, or is absent in a fresh generation."""
    problems = []
    for rel in fresh:
        target = ROOT / rel
        if not target.exists():
            problems.append(f"{rel.as_posix()}: missing")
        elif not filecmp.cmp(fresh_dir / rel, target, shallow=False):
            problems.append(f"{rel.as_posix()}: differs from its .proto")
    for rel in sorted(set(committed()) - set(fresh)):
        problems.append(f"{rel.as_posix()}: no .proto generates it any more")
    return problems


def write_in_place(fresh_dir: Path, fresh: list[Path]) -> None:
    (ROOT / PACKAGE).mkdir(parents=True, exist_ok=True)
    for rel in sorted(set(committed()) - set(fresh)):
        (ROOT / rel).unlink()
        print(f"removed {rel.as_posix()}")
    for rel in fresh:
        shutil.copyfile(fresh_dir / rel, ROOT / rel)
        print(f"wrote {rel.as_posix()}")
    init = ROOT / PACKAGE / "__init__.py"
    if not init.exists():
        init.write_text('"""Generated gRPC stubs of the strata.v1 API (scripts/gen_proto.py)."""\n')


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed stubs are stale; write nothing")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="strata-proto-") as tmp:
        fresh_dir = Path(tmp)
        fresh = generate(fresh_dir)
        if not args.check:
            write_in_place(fresh_dir, fresh)
            return 0
        problems = stale_files(fresh_dir, fresh)
    if not problems:
        print(f"stubs up to date ({len(fresh)} files)")
        return 0
    version = metadata.version("grpcio-tools")
    print("stale generated stubs:\n  " + "\n  ".join(problems), file=sys.stderr)
    print(f"regenerate with `python scripts/gen_proto.py` (grpcio-tools {version}; the committed stubs must come "
          "from the version pinned in pyproject.toml)", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
