"""The layering of docs/architecture.md holds in the code.

    strata (CLI, launcher, offline LLM)
        -> router, prefill_worker, decode_worker, worker_common
            -> engine, kvstore
                -> strata.v1 (generated contracts)

`engine` is the model runtime and imports none of the packages above it (nor `kvstore`: a worker wires the two
together). The router needs no tensors, so neither importing it nor loading the model it serves may import torch.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ABOVE_ENGINE = ("strata", "router", "kvstore", "prefill_worker", "decode_worker", "worker_common")
BUNDLED_MODEL = REPO / "models" / "strata-moe-tiny"


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in a file, function-level and `if TYPE_CHECKING:` ones included."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def forbidden_imports(package: str, forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for path in sorted((REPO / package).rglob("*.py")):
        for line, module in imported_modules(path):
            if module.split(".")[0] in forbidden:
                bad.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    return bad


def test_engine_imports_nothing_from_the_packages_above_it():
    assert forbidden_imports("engine", ABOVE_ENGINE) == []


def test_kvstore_imports_nothing_from_engine_or_the_packages_above_it():
    """The store moves bytes with a layout description; it does not run models (DESIGN §1)."""
    assert forbidden_imports("kvstore", ("engine",) + tuple(p for p in ABOVE_ENGINE if p != "kvstore")) == []


def router_modules() -> list[str]:
    return ["router"] + [f"router.{p.stem}" for p in sorted((REPO / "router").glob("*.py")) if p.stem != "__init__"]


def test_router_never_imports_torch():
    """Every router module (the gRPC service, the OpenAI door, `python -m router`'s main) and the model it serves
    (tokenizer, config, block-hash namespace) load in a fresh interpreter without torch."""
    script = f"""
import importlib, json, sys
first = None
for name in {router_modules()!r}:
    importlib.import_module(name)
    first = first or ("torch" in sys.modules and "importing " + name)
from router.served_model import ServedModel
model = ServedModel.load({str(BUNDLED_MODEL)!r})
print(json.dumps({{"torch": first or ("torch" in sys.modules and "ServedModel.load"),
                  "namespace": model.namespace.fingerprint().hex()}}))
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["torch"] is False, f"{report['torch']} imported torch"
    assert report["namespace"] == workers_namespace(BUNDLED_MODEL).hex()


def workers_namespace(path: Path) -> bytes:
    """The namespace root a worker hashes with (worker_common.engine_setup), from the loaded model."""
    from engine.config import CacheConfig, ModelConfig
    from engine.model_runner import ModelRunner
    from strata.llm import kv_namespace

    cache = CacheConfig()
    return kv_namespace(ModelRunner(ModelConfig(str(path)), cache), cache, "float32").fingerprint()
