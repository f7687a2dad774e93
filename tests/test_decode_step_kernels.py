"""The fused kernels of a decode step. The static-decode attention kernel (q/k norms, RoPE, cache write and attention in one
launch) gives the outputs and cache entries of the plain-torch static path, which attends over
each slot's gathered capacity under a visibility mask: at 1, 5 (padded to 8) and 64 rows, full
and sliding-window (ring) caches, with and without q/k norms and sinks, in float32 and bf16. With
verify windows (several rows of one slot at consecutive positions, beside single and padded rows)
the kernel, the torch static path and general frames (per-stream causal attention) agree, outputs
and cache entries; this runs in triton's interpreter on CPUs too. The residual add + RMS norm
kernel gives the torch add and norm."""

from __future__ import annotations

import os

import pytest
import torch
from gpu_cases import cuda_only

from modelfleet.engine.formats.base import triton_available
from modelfleet.engine.frame import segments_of
from modelfleet.engine.kernels import add_rms_norm, decode_attention
from modelfleet.engine.kvcache import LayerKV
from modelfleet.engine.layers import Attention, Dense, FrameContext, RMSNorm
from modelfleet.engine.rope import Rotary
from modelfleet.engine.spec import RopeSpec

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, SLOTS = 256, 8, 2, 64, 80

CASES = [  # (rows, real rows, q/k norms, window (a ring of window + 3 entries), sinks, capacity)
    (1, 1, True, None, False, 40),
    (8, 5, True, None, False, 40),
    (64, 64, False, None, True, 200),
    (8, 6, False, 6, True, 40),
    (64, 40, True, 6, False, 40),
]


def attention(dtype: torch.dtype, device: str, norms: bool, window: int | None, sinks: bool) -> Attention:
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int, scale: float = 0.05) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    qkv = Dense(rand((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN))
    o_proj = Dense(rand(HIDDEN, HEADS * HEAD_DIM))
    q_norm = RMSNorm(1 + rand(HEAD_DIM, scale=0.3), 1e-6) if norms else None
    k_norm = RMSNorm(1 + rand(HEAD_DIM, scale=0.3), 1e-6) if norms else None
    rotary = Rotary(RopeSpec(theta=10000.0), HEAD_DIM, 4096)
    sink_logits = rand(HEADS, scale=1.0) if sinks else None
    return Attention(qkv, o_proj, HEADS, KV_HEADS, HEAD_DIM, rotary, q_norm, k_norm, window, sink_logits)


def step(  # type: ignore[no-untyped-def]
    attn: Attention, kv: LayerKV, x: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, real: int,
    spare: torch.Tensor | None = None, windows: bool = False,
):  # fmt: skip
    """A static step; ``spare``: the positions padded rows write back (default: each row's next)."""
    valid = None
    if real < x.shape[0]:
        valid = torch.arange(x.shape[0], device=x.device) < real
    spare = positions + 1 if spare is None else spare
    ctx = FrameContext(None, positions, slots, valid=valid, spare_positions=spare, windows=windows)
    return attn(x, ctx, kv)


@cuda_only
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("rows", "real", "norms", "window", "sinks", "capacity"), CASES)
def test_the_fused_decode_kernel_gives_the_torch_static_path(monkeypatch, dtype, rows, real, norms, window, sinks, capacity):  # fmt: skip
    device = "cuda"
    attn = attention(dtype, device, norms, window, sinks)
    ring = window is not None
    capacity = window + 3 if window is not None else capacity
    g = torch.Generator().manual_seed(1)
    caches = [LayerKV.uniform(SLOTS, capacity, attn.cache_shapes(), dtype, torch.device(device), ring) for _ in "ab"]
    for name, t in caches[0].tensors.items():
        t.copy_(torch.randn(t.shape, generator=g).to(dtype))
        caches[1].tensors[name].copy_(t)
    order = torch.randperm(SLOTS, generator=g)[:real]
    slots = torch.cat([order, order[: rows - real]]).to(device)  # padded row i repeats real row i
    top = 4 * capacity if ring else capacity
    positions = torch.randint(0, top, (real,), generator=g)
    positions[0] = top - 1  # one row at the last entry (a ring's wrap)
    positions = torch.cat([positions, positions[: rows - real]]).to(device)
    x = torch.randn(rows, HIDDEN, generator=g).to(device=device, dtype=dtype)

    assert decode_attention.applies(x, caches[0].tensors["k"], HEADS, KV_HEADS, HEAD_DIM)
    ours = step(attn, caches[0], x, slots, positions, real)
    monkeypatch.setattr(decode_attention, "applies", lambda *args: False)
    ref = step(attn, caches[1], x, slots, positions, real)

    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours[:real].float(), ref[:real].float(), atol=tolerance, rtol=tolerance)
    for name, t in caches[0].tensors.items():
        torch.testing.assert_close(t.float(), caches[1].tensors[name].float(), atol=tolerance, rtol=0)


WINDOW_CASES = [  # (rows, each slot's rows in order, q/k norms, window (a ring of window + 3 entries), sinks)
    (16, [4, 1, 3, 1, 2, 1], True, None, False),  # 12 real rows, 4 padded (repeating a window's rows)
    (8, [2, 3], False, None, True),  # 5 real rows, 3 padded
    (16, [4, 4, 1, 3, 4], True, 6, True),  # a ring whose window's rows span the most it allows: 4
    (4, [4], False, 6, False),  # one stream's window alone, its rows wrapping the ring
]


def check_verify_windows(device: str, dtype: torch.dtype, rows: int, runs: list[int], norms: bool,
                         window: int | None, sinks: bool) -> None:  # fmt: skip
    """The fused kernel (``windows``: write, then attend) against the torch static path and against
    general frames (each stream's rows attending causally over its cache), outputs and caches."""
    attn = attention(dtype, device, norms, window, sinks)
    ring = window is not None
    capacity = window + 3 if window is not None else 40
    g = torch.Generator().manual_seed(2)
    caches = [LayerKV.uniform(SLOTS, capacity, attn.cache_shapes(), dtype, torch.device(device), ring) for _ in "abc"]
    for name, t in caches[0].tensors.items():
        t.copy_(torch.randn(t.shape, generator=g).to(dtype))
        for other in caches[1:]:
            other.tensors[name].copy_(t)
    chosen = torch.randperm(SLOTS, generator=g)[: len(runs)].tolist()
    top = 4 * capacity if ring else capacity
    slot_rows: list[int] = []
    position_rows: list[int] = []
    for i, (slot, count) in enumerate(zip(chosen, runs, strict=True)):
        start = top - count if i == 0 else int(torch.randint(0, top - count + 1, (1,), generator=g))
        slot_rows += [slot] * count
        position_rows += range(start, start + count)
    real = len(slot_rows)
    assert rows // 2 < real <= rows
    segments = segments_of(slot_rows, position_rows)
    ends = [seg.pos_end for seg in segments for _ in range(seg.rows)]
    x_rows = torch.randn(real, HIDDEN, generator=g).to(device=device, dtype=dtype)
    # the static step takes its rows in reverse: a window's later rows run first, so an entry read
    # before it is written shows even in triton's interpreter (which runs programs in order)
    order = list(range(real))[::-1] + list(range(real))[::-1][: rows - real]  # padded row i repeats real row i
    slots = torch.tensor([slot_rows[r] for r in order], device=device)
    positions = torch.tensor([position_rows[r] for r in order], device=device)
    spare = torch.tensor([ends[r] for r in order], device=device)
    x = x_rows[order]

    applies = decode_attention.applies
    if device == "cpu":  # triton's interpreter
        decode_attention.applies = lambda *args: True  # type: ignore[assignment]
    try:
        ours = step(attn, caches[0], x, slots, positions, real, spare, windows=True)
        decode_attention.applies = lambda *args: False  # type: ignore[assignment]
        ref = step(attn, caches[1], x, slots, positions, real, spare, windows=True)
        frames = attn(x_rows, FrameContext(segments, torch.tensor(position_rows, device=device)), caches[2])
    finally:
        decode_attention.applies = applies  # type: ignore[method-assign]

    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    for expected in (ref[:real], frames[order[:real]]):
        torch.testing.assert_close(ours[:real].float(), expected.float(), atol=tolerance, rtol=tolerance)
    for name, t in caches[0].tensors.items():
        for other in caches[1:]:
            torch.testing.assert_close(t.float(), other.tensors[name].float(), atol=tolerance, rtol=0)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or not triton_available(),
    reason="runs the Triton kernels on CPU only under TRITON_INTERPRET=1 with triton installed",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("rows", "runs", "norms", "window", "sinks"), WINDOW_CASES)
def test_verify_windows_in_the_decode_kernel_give_causal_attention_in_the_interpreter(dtype, rows, runs, norms, window, sinks):  # fmt: skip
    check_verify_windows("cpu", dtype, rows, runs, norms, window, sinks)


@cuda_only
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("rows", "runs", "norms", "window", "sinks"), WINDOW_CASES)
def test_verify_windows_in_the_decode_kernel_give_causal_attention(dtype, rows, runs, norms, window, sinks):
    check_verify_windows("cuda", dtype, rows, runs, norms, window, sinks)


@cuda_only
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("rows", "hidden"), [(1, 2048), (9, 300), (256, 1024)])
def test_the_fused_residual_add_and_norm_give_the_torch_add_and_norm(dtype, rows, hidden):
    g = torch.Generator().manual_seed(rows)
    x, delta = (torch.randn(rows, hidden, generator=g).to(device="cuda", dtype=dtype) for _ in "xd")
    norm = RMSNorm((1 + 0.3 * torch.randn(hidden, generator=g)).to(device="cuda", dtype=dtype), 1e-6)
    assert add_rms_norm.applies(x, delta)
    h, y = norm.after_add(x, delta)
    assert torch.equal(h, x + delta)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.float(), norm(x + delta).float(), atol=tolerance, rtol=tolerance)
