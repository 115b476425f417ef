"""Read a `quantization_config` (sub)dict so that every refusal names the field, the value and what is supported.

    Fields(qc, "quantization_config", source).choice("version", ("gemm",))
      -> ConfigFieldError("<source>: quantization_config.version is 'gemv'; supported: ['gemm']")
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.models.errors import ConfigFieldError

_REQUIRED = object()


@dataclass(frozen=True)
class Fields:
    """`data` is the dict found at `path` (e.g. "quantization_config.config_groups.group_0.weights") of the
    config.json named by `source`."""

    data: dict[str, Any]
    path: str
    source: str

    def name(self, key: str) -> str:
        return f"{self.path}.{key}"

    def error(self, key: str, got: Any, supported: Any) -> ConfigFieldError:
        shown = "missing" if got is _REQUIRED else repr(got)
        return ConfigFieldError(f"{self.source}: {self.name(key)} is {shown}; supported: {supported}")

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def get(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        return default if value is None else value

    def choice(self, key: str, supported: tuple[Any, ...], default: Any = _REQUIRED) -> Any:
        """The value (lower-cased when a string) if it is one of `supported`; `default` when absent or null."""
        value = self.data.get(key)
        if value is None:
            if default is _REQUIRED:
                raise self.error(key, _REQUIRED, list(supported))
            return default
        if isinstance(value, str):
            value = value.lower()
        if isinstance(value, bool) != any(isinstance(s, bool) for s in supported) or value not in supported:
            raise self.error(key, value, list(supported))
        return value

    def flag(self, key: str, default: bool) -> bool:
        return self.choice(key, (True, False), default)

    def integer(self, key: str, default: Any = _REQUIRED) -> int:
        value = self.data.get(key)
        if value is None and default is not _REQUIRED:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, _REQUIRED if value is None else value, "an integer")
        return value

    def strings(self, key: str) -> tuple[str, ...]:
        """A list of strings (absent or null: empty)."""
        value = self.data.get(key)
        if value is None:
            return ()
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.error(key, value, "a list of strings")
        return tuple(value)

    def sub(self, key: str) -> Fields | None:
        """The nested dict at `key` (None when absent or null)."""
        value = self.data.get(key)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self.error(key, value, "an object")
        return Fields(value, self.name(key), self.source)

    def refuse_set(self, key: str, why: str) -> None:
        """Raise if `key` holds anything but null / false / an empty container."""
        value = self.data.get(key)
        if value not in (None, False, {}, [], ""):
            raise ConfigFieldError(f"{self.source}: {self.name(key)} is {value!r}; supported: null or empty ({why})")
