"""`RecordingLauncher`: stands in for `strata.launcher.LocalLauncher` in tests of `strata serve`'s flags: it records
the `ServeConfig` the CLI built and starts nothing (its `start` fails with exit code 3, which the CLI returns)."""
from __future__ import annotations

from strata.launcher import ServeConfig


class RecordingLauncher:
    configs: list[ServeConfig] = []

    def __init__(self, config: ServeConfig, log=None) -> None:
        RecordingLauncher.configs.append(config)

    def start(self):
        from strata.launcher import LaunchError
        raise LaunchError("not started (test)", "router", 3)

    def stop(self) -> None:
        pass

    def interrupt(self) -> None:
        pass
