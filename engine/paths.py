"""Where modelfleet keeps what it builds on a machine (compiled kernels, compiled OpenVINO blocks):
one rule for every cache, so a pod or a user moves them all the same way."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir(name: str, env: str) -> Path:
    """$``env`` when set, else $XDG_CACHE_HOME/modelfleet/``name`` (~/.cache/modelfleet/``name``)."""
    configured = os.environ.get(env)
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "modelfleet" / name
