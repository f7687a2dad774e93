"""Shared fixtures: tiny random checkpoints saved once per test session."""

from __future__ import annotations

import importlib.util
import os
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


def _interpreter_takes_numpy_2() -> None:
    """Triton 3.6's interpreter turns a one-element kernel value into a Python int with int() on
    a 1-d array, which numpy 2.x refuses ("only 0-dimensional arrays..."); read the element."""
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope):  # type: ignore[no-untyped-def]
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
    _interpreter_takes_numpy_2()
