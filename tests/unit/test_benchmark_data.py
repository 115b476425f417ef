"""benchmarks/data/ ships the public traces the benchmarks read, each as its README describes it."""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "benchmarks" / "data"
SUM_LINE = re.compile(r"^([0-9a-f]{64})  (\S+)$", re.MULTILINE)


def readme_sums() -> dict[str, str]:
    return {name: digest for digest, name in SUM_LINE.findall((DATA / "README.md").read_text())}


def test_every_trace_file_matches_its_readme_sha256():
    sums = readme_sums()
    assert sums, "benchmarks/data/README.md lists no SHA-256 sums"
    for name, digest in sums.items():
        assert hashlib.sha256((DATA / name).read_bytes()).hexdigest() == digest, name


def test_every_file_in_the_data_folder_is_described_in_its_readme():
    shipped = {p.name for p in DATA.iterdir() if p.is_file()} - {"README.md"}
    assert shipped == set(readme_sums())
