"""The residual stream a pipeline stage passes on: the shape of one row, as each family answers it.

Most families pass ``[rows, hidden_size]``; DeepSeek-V4 passes its ``hc_mult`` hyper-connection
streams, ``[rows, hc_mult, hidden_size]``. Always float32 between stages. The shard (what it takes
and gives, so a stage refuses rows of another shape) and the tests of the wire ask
:func:`residual_shape`. Torch-free: the family is imported only when asked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .models import family

if TYPE_CHECKING:
    from .spec import ModelSpec


def residual_shape(spec: ModelSpec) -> tuple[int, ...]:
    """One row of the residual: ``(hidden_size,)``, or the family's own ``residual_shape(spec)``."""
    answer = getattr(family(spec.family), "residual_shape", None)
    return (spec.hidden_size,) if answer is None else tuple(int(n) for n in answer(spec))
