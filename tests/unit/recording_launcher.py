"""`RecordingLauncher`: stands in for `strata.launcher.LocalLauncher` in tests of `strata serve`'s flags: it records
the `ServeConfig` the CLI built and starts nothing (its `start` fails with exit code 3, which the CLI returns)."""
from __future__ import annotations

from strata.launcher import ServeConfig


class RecordingLauncher:
    configs: list[ServeConfig] = []
    envs: list[dict[str, str]] = []      # the environment each launch would hand its parts (the fleet secret)

    def __init__(self, config: ServeConfig, log=None, env=None) -> None:
        RecordingLauncher.configs.append(config)
        RecordingLauncher.envs.append(dict(env or {}))

    def start(self):
        from strata.launcher import LaunchError
        raise LaunchError("not started (test)", "router", 3)

    def stop(self) -> None:
        pass

    def interrupt(self) -> None:
        pass
