"""vLLM's own KV-event and block-hashing code, from its published wheel, as the oracle of the compatibility tests
(issue 18). Nothing of vLLM is copied into this repository.

The wheel is downloaded once (`pip download --no-deps vllm==VERSION`, about 240 MB) into
`~/.cache/strata/vllm-wheel/` (`STRATA_CACHE_DIR` replaces `~/.cache/strata`), and only these files are extracted,
into `~/.cache/strata/vllm-VERSION/`:

    vllm/distributed/kv_events.py   the event structs (msgspec), ZmqEventPublisher and its replay socket
    vllm/config/kv_events.py        KVEventsConfig, which the publisher builds
    vllm/v1/core/kv_cache_utils.py  hash_block_tokens, init_none_hash, the request block hasher, extra keys
    vllm/utils/hashing.py           sha256, sha256_cbor, xxhash, xxhash_cbor
    vllm/envs.py                    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES and the rest of vLLM's settings

They are imported under their own names; the heavy modules they import (model configs, multimodal, the v1 request,
torch helpers) are stub modules, in the test process's `sys.modules` only while vLLM's modules load. Where the wheel cannot be had
(no network, no pip), the tests that need it skip saying so; with `STRATA_REQUIRE_VLLM=1` (set by `.ci/run`) they
fail instead. `STRATA_VLLM_VERSION` picks another release (default below: the newest checked).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path
from typing import Any

import pytest

VLLM_VERSION = os.environ.get("STRATA_VLLM_VERSION", "0.34.0")
FILES = ("vllm/envs.py", "vllm/utils/hashing.py", "vllm/config/kv_events.py", "vllm/v1/core/kv_cache_utils.py",
         "vllm/distributed/kv_events.py")
_STUB_PACKAGES = ("vllm", "vllm.config", "vllm.utils", "vllm.v1", "vllm.v1.core", "vllm.distributed",
                  "vllm.multimodal", "vllm.multimodal.utils", "vllm.utils.math_utils", "vllm.utils.network_utils",
                  "vllm.v1.kv_cache_interface", "vllm.v1.kv_cache_spec_registry", "vllm.v1.request",
                  "vllm.v1.token_buffer", "vllm.v1.utils")
_DOWNLOAD_TIMEOUT_S = 1800


class VllmUnavailable(RuntimeError):
    """vLLM's wheel could not be had (the message says why)."""


def cache_dir() -> Path:
    return Path(os.environ.get("STRATA_CACHE_DIR", "~/.cache/strata")).expanduser()


def _wheel() -> Path:
    folder = cache_dir() / "vllm-wheel"
    found = sorted(folder.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    # NOTE: one platform's wheel, whatever this machine is: only its pure-Python files are read
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--platform",
           "manylinux_2_28_x86_64", "--progress-bar", "off", "-d", str(folder), f"vllm=={VLLM_VERSION}"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=_DOWNLOAD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise VllmUnavailable(f"`{' '.join(cmd)}` failed: {exc}") from exc
    found = sorted(folder.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    if done.returncode != 0 or not found:
        raise VllmUnavailable(f"`{' '.join(cmd)}` exited {done.returncode}: {done.stderr.strip()[-600:]}")
    return found[0]


def source_dir() -> Path:
    """The extracted files, from the cached wheel (downloaded first when missing)."""
    target = cache_dir() / f"vllm-{VLLM_VERSION}"
    if all((target / f).is_file() for f in FILES):
        return target
    with zipfile.ZipFile(_wheel()) as wheel:
        for name in FILES:
            wheel.extract(name, target)
    return target


class _Stub(types.ModuleType):
    """A module whose every missing attribute is a placeholder class (what vLLM's annotations and base classes
    need from modules the tests never exercise)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        placeholder = type(name, (), {"__init__": lambda self, *args, **kwargs: None})
        setattr(self, name, placeholder)
        return placeholder


def _install_stubs() -> None:
    for name in _STUB_PACKAGES:
        module = _Stub(name)
        module.__path__ = []
        sys.modules[name] = module
        parent, _, leaf = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], leaf, module)
    for name, attrs in (("vllm.logger", {"init_logger": logging.getLogger}),
                        ("vllm.config.utils", {"config": dataclasses.dataclass})):
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        sys.modules[name] = module
    sys.modules["vllm.v1.token_buffer"].token_slice = lambda ids, start, end: list(ids[start:end])
    sys.modules["vllm.utils.math_utils"].cdiv = lambda a, b: -(-a // b)


def _remove_stubs() -> None:
    """Take the stubs out of `sys.modules` once vLLM's modules are loaded (they keep what they imported), so no
    other test or library (transformers asks whether vllm is installed) mistakes them for vLLM."""
    for name in (*_STUB_PACKAGES, "vllm.logger", "vllm.config.utils"):
        sys.modules.pop(name, None)


def _load(root: Path, relative: str) -> types.ModuleType:
    name = relative.removesuffix(".py").replace("/", ".")
    spec = importlib.util.spec_from_file_location(name, root / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    parent, _, leaf = name.rpartition(".")
    setattr(sys.modules[parent], leaf, module)
    return module


@dataclasses.dataclass(frozen=True)
class VllmCode:
    """vLLM's modules, as its wheel ships them."""

    version: str
    source: Path
    envs: types.ModuleType
    hashing: types.ModuleType
    kv_cache_utils: types.ModuleType
    kv_events: types.ModuleType

    def none_hash(self, algo: str) -> bytes:
        """Set vLLM's NONE_HASH for `algo` (as the engine does at start) and return it."""
        self.kv_cache_utils.init_none_hash(self.hashing.get_hash_fn_by_name(algo))
        return self.kv_cache_utils.NONE_HASH


@functools.lru_cache(maxsize=1)
def load_vllm() -> VllmCode:
    """VllmUnavailable where the wheel cannot be had."""
    try:
        import cbor2  # noqa: F401  (vllm/utils/hashing.py imports it)
        import msgspec  # noqa: F401  (vllm/distributed/kv_events.py)
    except ImportError as exc:
        raise VllmUnavailable(f"{exc.name} is not installed (pip install -e .[test])") from exc
    root = source_dir()
    _install_stubs()
    try:
        modules = {f: _load(root, f) for f in FILES}
    finally:
        _remove_stubs()
    return VllmCode(VLLM_VERSION, root, modules["vllm/envs.py"], modules["vllm/utils/hashing.py"],
                    modules["vllm/v1/core/kv_cache_utils.py"], modules["vllm/distributed/kv_events.py"])


@pytest.fixture(scope="session")
def vllm() -> VllmCode:
    """vLLM's own code; skips (fails under STRATA_REQUIRE_VLLM=1) where its wheel cannot be had."""
    try:
        return load_vllm()
    except VllmUnavailable as exc:
        message = f"vLLM {VLLM_VERSION}'s wheel is not available: {exc}"
        if os.environ.get("STRATA_REQUIRE_VLLM"):
            pytest.fail(message + " (STRATA_REQUIRE_VLLM=1: CI requires it)")
        pytest.skip(message + " (CI requires it: STRATA_REQUIRE_VLLM=1)")
