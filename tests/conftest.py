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


def _interpreter_computes_bfloat16() -> None:
    """Triton 3.6's interpreter keeps bf16 values as their 16-bit codes (numpy has no bfloat16):
    tl.dot multiplies those codes as integers, and float32 -> bf16 casts truncate where a GPU rounds
    to nearest even. Decode bf16 dot operands to float32 first (exact), as tensor cores read them,
    and round casts to nearest even, so bf16 kernels can be checked on CPUs."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    dot, cast = builder.create_dot, builder.cast_impl

    def decoded(x):  # type: ignore[no-untyped-def]
        if x.dtype.scalar != tl.bfloat16:
            return x
        return interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def dot_decoded(self, a, b, d, input_precision, max_num_imprecise_acc):  # type: ignore[no-untyped-def]
        return dot(self, decoded(a), decoded(b), d, input_precision, max_num_imprecise_acc)

    def cast_rounded(self, src, dst_type):  # type: ignore[no-untyped-def]
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return cast(self, src, dst_type)
        bits = src.data.astype(np.float32).view(np.uint32)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # finite values
        return interpreter.TensorHandle(rounded, tl.bfloat16)

    builder.create_dot, builder.cast_impl = dot_decoded, cast_rounded


if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
    _interpreter_takes_numpy_2()
    _interpreter_computes_bfloat16()
