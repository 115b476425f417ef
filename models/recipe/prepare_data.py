"""Corpus for the bundled models: the Python 3.11 standard library's own ``.py`` sources.

Two steps, both deterministic:

1. ``python models/recipe/prepare_data.py lists`` walks ``sysconfig.get_paths()['stdlib']``, keeps every ``.py``
   file outside ``site-packages`` and outside test folders, sorts by relative path, and splits train / held-out BY
   FILE with a hash of the relative path (about 3% held out). The two lists are written next to this script
   (``train_files.txt``, ``heldout_files.txt``) and committed, so the split never depends on the walk order.
2. ``python models/recipe/prepare_data.py tokenize --tokenizer models/strata-moe-tiny`` encodes both lists with the
   trained tokenizer and writes ``runs/data/{train,heldout}.bin`` (uint16 token ids, documents joined by
   ``<|endoftext|>``) plus ``runs/data/meta.json``.

Test folders (``test/``, ``tests/``, ``idle_test/``) are EXCLUDED: they hold deliberately malformed sources,
odd encodings and large data literals, and are dominated by repetitive ``assertEqual`` scaffolding. Files that are
not valid UTF-8 are skipped too. What remains (~14 MB) is library code, the style the demo model should imitate.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sysconfig
from pathlib import Path

import numpy as np

RECIPE_DIR = Path(__file__).resolve().parent
REPO_ROOT = RECIPE_DIR.parent.parent
DATA_DIR = REPO_ROOT / "runs" / "data"
TRAIN_LIST = RECIPE_DIR / "train_files.txt"
HELDOUT_LIST = RECIPE_DIR / "heldout_files.txt"
EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__"})
HELDOUT_PER_MILLE = 30  # ~3% of files
EOT = "<|endoftext|>"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(rel_path: str) -> bool:
    """Stable across machines and Python runs (no ``hash()`` randomisation)."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 1000 < HELDOUT_PER_MILLE


def stdlib_sources(root: Path) -> list[str]:
    """Relative paths of the stdlib's UTF-8 ``.py`` files, test folders excluded, sorted."""
    keep = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]):
            continue
        try:
            path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        keep.append(rel.as_posix())
    return sorted(keep)


def write_lists() -> None:
    files = stdlib_sources(stdlib_root())
    heldout = [f for f in files if is_heldout(f)]
    train = [f for f in files if not is_heldout(f)]
    TRAIN_LIST.write_text("\n".join(train) + "\n")
    HELDOUT_LIST.write_text("\n".join(heldout) + "\n")
    print(f"{len(train)} train files, {len(heldout)} held-out files -> {RECIPE_DIR}")


def read_list(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line]


def read_texts(list_path: Path) -> list[str]:
    root = stdlib_root()
    return [(root / rel).read_text(encoding="utf-8") for rel in read_list(list_path)]


def encode_files(tokenizer, list_path: Path) -> np.ndarray:
    eot_id = tokenizer.token_to_id(EOT)
    ids: list[int] = []
    for enc in tokenizer.encode_batch(read_texts(list_path)):
        ids.extend(enc.ids)
        ids.append(eot_id)
    return np.asarray(ids, dtype=np.uint16)


def tokenize(tokenizer_dir: Path) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    meta = {}
    for split, list_path in (("train", TRAIN_LIST), ("heldout", HELDOUT_LIST)):
        tokens = encode_files(tokenizer, list_path)
        tokens.tofile(DATA_DIR / f"{split}.bin")
        n_bytes = sum(len(t.encode("utf-8")) for t in read_texts(list_path))
        meta[split] = {"tokens": int(tokens.size), "bytes": n_bytes, "bytes_per_token": n_bytes / tokens.size}
        print(f"{split}: {tokens.size} tokens, {n_bytes} bytes, {n_bytes / tokens.size:.2f} bytes/token")
    (DATA_DIR / "meta.json").write_text(json.dumps(meta, indent=2))


def load_tokens(split: str) -> np.ndarray:
    return np.fromfile(DATA_DIR / f"{split}.bin", dtype=np.uint16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="step", required=True)
    sub.add_parser("lists", help="write train_files.txt / heldout_files.txt")
    tok = sub.add_parser("tokenize", help="encode both splits into runs/data/")
    tok.add_argument("--tokenizer", type=Path, default=REPO_ROOT / "models" / "strata-moe-tiny")
    args = parser.parse_args()
    if args.step == "lists":
        write_lists()
    else:
        tokenize(args.tokenizer)


if __name__ == "__main__":
    main()
