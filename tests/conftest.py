"""Shared fixtures: tiny random checkpoints saved once per test session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny import save_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """tiny_checkpoint(family) -> (directory, transformers model), built once per family."""
    cache: dict[str, tuple[Path, object]] = {}

    def get(family: str):  # type: ignore[no-untyped-def]
        if family not in cache:
            path = tmp_path_factory.mktemp(family)
            cache[family] = (path, save_model(family, path))
        return cache[family]

    return get
