"""A cluster of its own for an e2e module whose workers need other flags than the session's (`conftest.cluster`)."""
from __future__ import annotations

import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from strata.launcher import LocalLauncher, ServeConfig
from tests.e2e.conftest import Cluster


@contextmanager
def own_cluster(config: ServeConfig, name: str, launcher_class: type[LocalLauncher] = LocalLauncher,
                env: dict[str, str] | None = None) -> Iterator[Cluster]:
    """Started with `launcher_class` (`strata serve`'s launcher by default), its prefixed log in a temporary file."""
    log_path = Path(tempfile.mkstemp(prefix=f"strata-e2e-{name}-", suffix=".log")[1])
    with log_path.open("w") as log:
        launcher = launcher_class(config, log=log, env=env)
        try:
            info = launcher.start()
        except Exception:
            log.flush()
            raise RuntimeError(f"the {name} cluster did not start:\n{log_path.read_text()[-6000:]}") from None
        try:
            yield Cluster(info, log_path)
        finally:
            launcher.stop()
