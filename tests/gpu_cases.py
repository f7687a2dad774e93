"""Marks shared by the GPU kernel tests (they skip on a machine without CUDA, as CI is)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def cuda_matmul_cases(names: Sequence[str]) -> Callable[[Any], Any]:
    """A GPU test over the formats ``names`` x 1, 8 and 64 rows x float32 and bf16 inputs: the
    test takes (name, rows, dtype)."""

    def apply(test: Any) -> Any:
        for mark in (
            pytest.mark.parametrize("name", names),
            pytest.mark.parametrize("rows", [1, 8, 64]),
            pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"]),
            pytest.mark.gpu,
            cuda_only,
        ):
            test = mark(test)
        return test

    return apply
