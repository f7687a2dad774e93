"""Expert banks on the CPU: each used expert runs once over its rows, with as few tensor ops
around the experts as the row count allows (on a CPU every op costs microseconds of host time,
as much as a small expert's matmul at decode sizes).

- One row (batch-1 decode): its k experts are distinct, so no sort, count or gather: the k
  experts run on the row and one [1, k] x [k, H] product weighs and sums them.
- More rows: pairs sorted by expert, the rows gathered once in that order (each expert then
  reads a contiguous slice, a view), outputs put back in pair order by one indexed copy, and one
  batched [1, k] x [k, H] product per row weighs and sums them (no zero fill, no index_add_).

The result equals the per-expert reference (``layers.forward_grouped``) up to the order of the
k-term weighted sum (exact in float32 to rounding; bf16 sums once in float32 here instead of
rounding every add).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Expert = Callable[[int, torch.Tensor], torch.Tensor]


def grouped_cpu(
    expert: Expert, num_experts: int, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """x: [T, H]; index, weight: [T, k] -> sum_k weight * expert_index(x): [T, H]."""
    tokens, top_k = index.shape
    if tokens == 1:
        ys = torch.cat([expert(e, x) for e in index[0].tolist()])  # [k, H]
        return torch.mm(weight.to(ys.dtype), ys)
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    xs = x[order // top_k]  # [T*k, H]: rows in expert order
    outputs, start = [], 0
    for e, count in enumerate(counts):
        if count:
            outputs.append(expert(e, xs[start : start + count]))
            start += count
    ys = torch.cat(outputs)
    pairs = torch.empty_like(ys).index_copy_(0, order, ys)  # back in (token, k) order
    return torch.bmm(weight.to(ys.dtype)[:, None, :], pairs.view(tokens, top_k, -1))[:, 0]
