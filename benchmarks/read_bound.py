"""The read bound of an MoE step on CUDA: the time to read, for the same routing, the bytes the
expert kernels are credited with (every routed pair's slab of each bank tensor: codes, scales,
zero points, or plain weights), with no arithmetic. The slabs are read once per (token, expert)
pair as the kernels read them (a repeated expert hits L2), by programs of 16 KB, the pairs and
their slabs in the grid's first and second dimensions.

Two layouts of the same reads, beside the kernels in ``formats.py``:
- ``split``: one launch per bank, the gate_up bank's slabs then the down bank's, launched as the
  fused pair is: on Hopper and later as programmatic dependents, the first waiting for the launch
  before it at its start (the pair's gate_up kernel reads the router's expert index), the second
  issuing its loads before it waits (as the down kernel does);
- ``one``: one launch reading both banks (waiting at its start): a single kernel per step.

At a few MB per step these stay below the copy bandwidth (a launch, the first loads' latency and
the tail cost about as much as the transfer itself): they bound what kernels with that launch
structure can reach on the device they run on."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

SLOTS = 6  # tensors one launch can read (two banks of codes, scales, zero points)
CHUNK = 4096  # int32 words per program: 16 KB


@triton.jit
def _read_slabs(
    index_ptr, out_ptr,
    p0, p1, p2, p3, p4, p5, e0, e1, e2, e3, e4, e5, w0, w1, w2, w3, w4, w5, s1, s2, s3, s4, s5,
    CHUNK: tl.constexpr, PDL: tl.constexpr, WAIT_LATE: tl.constexpr,
):  # fmt: skip
    """Program (pair, c): chunk c of the slabs, counted across slots (slot i's chunks start at
    s_i, s_0 = 0), of expert index[pair]; xor-folded into out so the loads are kept. PDL: a
    programmatic dependent, waiting for the launch before at its start or (WAIT_LATE) only
    before its store."""
    pair, c = tl.program_id(0), tl.program_id(1)
    if PDL:
        gdc_launch_dependents()
        if not WAIT_LATE:
            gdc_wait()
    expert = tl.load(index_ptr + pair).to(tl.int64)
    base, stride, words, start = p0, e0, w0, 0
    if c >= s1:
        base, stride, words, start = p1, e1, w1, s1
    if c >= s2:
        base, stride, words, start = p2, e2, w2, s2
    if c >= s3:
        base, stride, words, start = p3, e3, w3, s3
    if c >= s4:
        base, stride, words, start = p4, e4, w4, s4
    if c >= s5:
        base, stride, words, start = p5, e5, w5, s5
    offs = (c - start) * CHUNK + tl.arange(0, CHUNK)
    v = tl.load(base + expert * stride + offs, mask=offs < words, other=0)
    fold = tl.xor_sum(v, axis=0)
    if PDL and WAIT_LATE:
        gdc_wait()
    tl.store(out_ptr + pair * tl.num_programs(1) + c, fold)


def slab_words(tensor: torch.Tensor) -> torch.Tensor:
    """An [E, ...] bank tensor as int32 words [E, words per expert] (the same memory)."""
    flat = tensor.contiguous().reshape(tensor.shape[0], -1)
    if flat.shape[1] * flat.element_size() % 4:
        raise ValueError(f"a slab of {tuple(tensor.shape)} {tensor.dtype} is not a whole number of 32-bit words")
    return flat.view(torch.int32)


class SlabReader:
    """Reads the routed slabs of up to ``SLOTS`` bank tensors in one launch (see the module);
    ``wait_late``: on Hopper and later, wait for the launch before only after issuing the loads."""

    def __init__(self, tensors: list[torch.Tensor], wait_late: bool = False) -> None:
        self.wait_late = wait_late
        if not 0 < len(tensors) <= SLOTS:
            raise ValueError(f"{len(tensors)} tensors: one launch reads 1 to {SLOTS}")
        self.words = [slab_words(t) for t in tensors]
        chunks = [triton.cdiv(w.shape[1], CHUNK) for w in self.words]
        self.starts = [sum(chunks[:i]) for i in range(len(chunks))]
        self.chunks = sum(chunks)
        self.out = torch.empty(0, dtype=torch.int32, device=tensors[0].device)

    def __call__(self, index: torch.Tensor) -> torch.Tensor:
        flat = index.reshape(-1)
        if self.out.numel() < flat.numel() * self.chunks:
            self.out = torch.empty(flat.numel() * self.chunks, dtype=torch.int32, device=flat.device)
        pad = SLOTS - len(self.words)
        words = self.words + [self.words[-1]] * pad
        strides = [w.stride(0) for w in words]
        counts = [w.shape[1] for w in words]
        starts = self.starts[1:] + [self.chunks] * pad  # slots past the last never start
        pdl = flat.is_cuda and torch.cuda.get_device_capability(flat.device)[0] >= 9
        _read_slabs[(flat.numel(), self.chunks)](
            flat, self.out, *words, *strides, *counts, *starts,
            CHUNK=CHUNK, PDL=pdl, WAIT_LATE=self.wait_late, num_warps=4, **({"launch_pdl": True} if pdl else {}),
        )  # fmt: skip
        return self.out
