"""Where the bundled files live, whether Strata runs from a checkout or an installed copy."""
from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_NAME = "strata-moe-tiny"
DEFAULT_DRAFT_NAME = "strata-draft-tiny"
DEFAULT_EAGLE_NAME = "strata-eagle-tiny"


def bundled_model(name: str = DEFAULT_MODEL_NAME) -> str:
    """Path of a bundled model; `STRATA_MODELS` overrides the folder that holds them."""
    base = Path(os.environ.get("STRATA_MODELS", REPO_ROOT / "models"))
    return str(base / name)


def resolve_model(model: str | None) -> str:
    """A folder path as given, or the name of a bundled model, or the embedded default."""
    if not model:
        return bundled_model()
    if Path(model).is_dir():
        return model
    candidate = Path(bundled_model(model))
    if candidate.is_dir():
        return str(candidate)
    raise ValueError(f"model must be a local folder or a bundled model name ({DEFAULT_MODEL_NAME!r}), got {model!r}")


def resolve_draft_model(method: str | None, path: str | None) -> str | None:
    """The speculative drafter's folder: `path` as given (a folder or a bundled name), else the bundled draft model
    (`draft`) or EAGLE head (`eagle`); None for `ngram` or no speculation. A folder that is not there is a
    ValueError naming `speculative_model` (here, before a worker loads anything, not in the middle of its start)."""
    if method not in ("draft", "eagle"):
        return None
    name = path or (DEFAULT_DRAFT_NAME if method == "draft" else DEFAULT_EAGLE_NAME)
    for candidate in ((Path(path),) if path else ()) + (Path(bundled_model(name)),):
        if candidate.is_dir():
            return str(candidate)
    if path:
        raise ValueError(f"speculative_model must be a local folder or a bundled model name, got {path!r}")
    what = "draft model" if method == "draft" else "EAGLE head"
    raise ValueError(f"speculative_model: speculative {method!r} defaults to the bundled {what} {name!r}, which is "
                     f"not installed; pass a folder (--speculative-model PATH)")
