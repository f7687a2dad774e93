"""The even split of a model's layers over pipeline stages: the one definition.

Ranges are half-open ``[layer_start, layer_end)``, contiguous and cover every layer; the first
``num_layers % parts`` stages hold one layer more (10 layers over 3 stages: 4, 3, 3). Used by
``modelfleet generate``'s shards in one process, the planner and the operator.
"""

from __future__ import annotations

from .errors import InputError


def even_split(num_layers: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges over ``num_layers`` layers, sizes differing by at most one."""
    if parts < 1:
        raise InputError(f"stages={parts} must be >= 1")
    if parts > num_layers:
        raise InputError(f"stages={parts} exceeds the model's {num_layers} layers; every stage holds at least one")
    base, extra = divmod(num_layers, parts)
    ends = [(k + 1) * base + min(k + 1, extra) for k in range(parts)]
    return list(zip([0, *ends[:-1]], ends, strict=True))
