"""MXFP4 and int4 decode steps of a quantized MoE bank on tensor cores (Hopper): the fused pair of
:mod:`.triton_moe` (``moe_up``: gate and up rows of each (token, expert) pair, bias, GLU;
``moe_down``: the token's pairs summed with their router weights), as Gluon kernels whose dot
products run on ``mma.sync.m16n8k16`` (f16 in, float32 accumulate), reading the banks exactly as
the Triton kernels hold them (nibble-major codes, E8M0 or fp16 scales [E, N, G], uint8 zero
points): no second layout.

Why: MXFP4's CUDA-core decode (two conversions and two FMAs per pair of nibbles) bounded the
one-token step; here a code word costs 10 integer instructions to become four exact f16 pairs, and
the MACs go to the tensor cores.

Mapping (the hardware's m16n8k16 fragments, lane = 4 g + t): a warp computes a 16-row tile; lane
(g, t) holds word t of each 32-input group for rows g and g + 8. In nibble-major order
(:func:`.base.to_nibble_major`) nibble i of word t is input 4i + t. ``_EO`` puts each nibble of
the word in a byte as s000eem0 (E the even nibbles, O the odd), the high byte of the f16 equal
to exactly 2^-14 x its E2M1 value, and one ``prmt`` gathers nibbles i and i + 4 (inputs 4i + t
and 4i + 16 + t) into the high bytes of an f16 pair (``_pair``). So a group is two k-tiles: tile
0 takes nibble pairs (0, 4) and (1, 5) of rows g and g + 8 as A registers 0..3, tile 1 takes
(2, 6) and (3, 7), and B holds the same inputs, (x[4i + t], x[4i + 16 + t]) in f16.

B's column g is group g of the chunk of 8 (the inputs lane (g, t) loaded itself: no shfl), so
the MMA of group k leaves the group's sums in column k only; the lanes holding column k (t = k
// 2: c0 / c2 for even k, c1 / c3 for odd) add them times the group's E8M0 scale, 2^(e - 127),
with a predicated FMA. A chunk's 8 groups run in one asm block (``_chunk_asm``), which extracts a
lane's two scales once; the 4 lanes of a row are added at the end, times 2^14 and the input
scale.

int4 (``INT4``): nibbles i and i + 4 are the f16 pair of subnormals q x 2^-24 for even i and
16 q x 2^-24 for odd i, each taken in place by one AND (w for i < 2, w >> 8 for i >= 2: one shift
per word, against three when every pair was shifted down to bits 0..3), exact; B holds the
inputs that meet odd i divided by 16, so the MMA still sums q x. The fold takes off z times the
group's input sum (from the lanes that loaded the group: two shfl per chunk), s (D - z Y). Zero
points come in the same operand as the lane's two fp16 scales; int4_sym's are 8. At one token
moe_down converts its int4 words to fragment order and shifts them before waiting on moe_up
(:func:`_predecoded`): only the ANDs and MMAs are left after the wait (MXFP4's moe_down predecodes
nothing: it is held to a register cap instead, :func:`_down_regs`). ptxas sinks such work past
``griddepcontrol.wait``, so the wait runs under a predicate computed from every prepared word
(always true, not foldable) and the activations' addresses add the 0 it returns.

Loads: each lane reads whole 16-byte groups (4 rows x 128 contiguous bytes per instruction), and
a layout conversion through shared memory hands lane (g, t) its words (loading them in fragment
order directly, 16 bytes per row per instruction, is slower for moe_up). The conversions are
warp-local; :func:`warp_barriers`, a pass on the kernels' PTX, turns the CTA barriers that only
guard their scratch's reuse into warp barriers. :func:`install_ptx_pass` adds it to Triton's
pipeline; :func:`moe_up` and :func:`moe_down` call it before their first launch (launch the kernels
only through them), and importing this module leaves Triton as it is.

Inputs in f16: x is scaled by 2^-k per warp (undone exactly in the fold). MXFP4: k > 0 only
when the warp's largest |x| reaches 2^15 (so nothing overflows f16); inputs below 2^-14 (x 2^k)
lose bits as f16 subnormals, absolute error below 2^-25 x 2^k per input. int4: k puts the warp's
largest |x| in [2^14, 2^15), small inputs scaled up, so only inputs more than 2^24 below the
warp's largest lose bits, although B holds half of them / 16.

Between the two kernels (:func:`.triton_moe.moe_pair`) the activations travel t-major
(:func:`t_major`: within each group of 32, input 4i + t at 8t + i), so a moe_down lane reads its
8 inputs of a group in two 8-byte loads rather than eight 2-byte ones on the few lines every CTA
reads. From two tokens on, a moe_up program computes two tiles of 8 rows, its warps packing the
inputs once for both (``_up_tiles``).

At one token the schedule differs from two tokens on (each a measured decision): MXFP4's moe_up
staggers its chunks' code loads (``STAGGER``), moe_up's grid runs an expert's row tiles as
consecutive programs (``ROWS_FIRST``), the scales and zero points are loaded evict-first
(:func:`_scales_evict`), int4's moe_down predecodes and MXFP4's is register-capped. The
measurements behind these and the alternatives dropped are in
``docs/results/kernel_tuning_history.md``.

Applies on compute capability 9 with bf16/fp16 activations, MXFP4 banks (any group count: the
last chunk of 8 groups is masked, as GPT-OSS's 90 need, and a lane loads its two scale bytes
apart) or int4 banks with fp16 scales and an even group count, top_k a power of two up to 8, and
token counts up to ``CONFIG.max_tokens`` (``up_applies``, ``down_applies``); elsewhere the
Triton kernels run. The kernels use inline PTX (mma, prmt, predicated FMA), so they run only on
the GPU, not in triton's interpreter.

One module: the asm texts, the Gluon helpers that wrap them, the two kernels, their PTX pass and
their launchers share the fragment layout and the chunk asm's operand numbering, which no part
can change alone.
"""

# The kernels grow tuples of tensors in static loops (ws = ws + (load,)), which mypy types as the
# empty tuple they start as.
# mypy: disable-error-code="assignment,misc,var-annotated"

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import triton.language as tl

from .banks import CONFIG

if TYPE_CHECKING:
    from .banks import Activation, PackedBank

try:  # Gluon ships with triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # pragma: no cover - older triton: the Triton kernels serve every case
    gluon = None

CHUNK = 8  # groups per chunk: one 8-byte load of a row's scales
GC = tl.constexpr(CHUNK)

# a code word's nibbles as f16 high bytes s000eem0 (sign to bit 7, magnitude to bits 1..3: with a
# zero low byte, exactly 2^-14 x the E2M1 value): byte b of E is nibble 2b, byte b of O nibble 2b + 1.
# Six instructions: y = the word's 8 sign bits (bits 3 and 7 of each byte), shared. Each lop3 takes
# bits 1..3 of every byte from the shifted word and the rest from the signs, (x & C) | (y & ~C): the
# signs it must drop (bit 3 of a byte in O, and in E the odd nibbles' signs shifted to bit 3 of the
# next byte) fall inside C, bits 1..3
_EO = (
    "and.b32 y, {w}, 0x88888888; shl.b32 x, {w}, 1; shl.b32 z, y, 4; lop3.b32 {e}, x, 0x0e0e0e0e, z, 0xe2;"
    " shr.u32 x, {w}, 3; lop3.b32 {o}, x, 0x0e0e0e0e, y, 0xe2;"
)


def _pair(i: int, e: str, o: str, a: str) -> str:
    """Nibbles i and i + 4 (inputs 4i + t and 4i + 16 + t) as one f16 pair in register a: byte
    i // 2 and i // 2 + 2 of E (i even) or O (i odd) into the halves' high bytes, one prmt."""
    return f"prmt.b32 {a}, {e if i % 2 == 0 else o}, 0, {'0x2404' if i < 2 else '0x3414'};"


_MMA = (
    "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{d0, d1, d2, d3}}, {{a0, a1, a2, a3}}, {{{b0}, {b1}}}, {{{c}}};"
)
# lane t: predicates p0..p3 (t == 0..3), and where its two groups' scale bytes (2t and 2t + 1 of a
# row's 8 for the chunk) sit: the high word when t > 1, bytes 2 (t % 2) and 2 (t % 2) + 1 of it,
# as prmt selectors c0 / c1 that put that byte alone in byte 0
_LANE = (
    "mov.u32 t, %laneid; and.b32 t, t, 3; setp.eq.u32 p0, t, 0; setp.eq.u32 p1, t, 1; setp.eq.u32 p2, t, 2;"
    " setp.eq.u32 p3, t, 3; setp.gt.u32 hw, t, 1; and.b32 sh, t, 1; shl.b32 sh, sh, 1; or.b32 c0, sh, 0x4440;"
    " or.b32 c1, sh, 0x4441;"
)
# a row's 8 scale bytes e (E8M0) -> float32 2^(byte - 127) of bytes 2t (s0) and 2t + 1 (s1): a prmt
# puts the byte in byte 0 (zeros above), a shift into the exponent; byte 0 gives 2^-127 (subnormal)
_SCALES = (
    "mov.b64 {{lo, hi}}, {e}; selp.b32 sel, hi, lo, hw;"
    " prmt.b32 x, sel, 0, c0; shl.b32 x, x, 23; max.u32 x, x, 0x00400000; mov.b32 {s0}, x;"
    " prmt.b32 x, sel, 0, c1; shl.b32 x, x, 23; max.u32 x, x, 0x00400000; mov.b32 {s1}, x;"
)


def _pair_int4(i: int, w: str, w8: str, a: str) -> str:
    """int4: nibbles i and i + 4 of word w (w8: w >> 8) as an f16 pair of subnormals, exact: q x
    2^-24 for even i (bits 0..3 of each half), 16 q x 2^-24 for odd i (bits 4..7, taken in place:
    the B registers they meet hold the inputs / 16). One AND each, and one shift per word."""
    return f"and.b32 {a}, {w if i < 2 else w8}, {'0x000f000f' if i % 2 == 0 else '0x00f000f0'};"


# int4: a row's operand e = its fp16 scales of groups 2t, 2t + 1 (low word) and their zero points
# (bytes 0, 1 of the high word) -> s0, s1, z0, z1 as float32 (integer converts: a prmt into 2^23's
# bits costs moe_up registers)
_SCALES_INT4 = (
    "mov.b64 {{lo, hi}}, {e}; mov.b32 {{h0, h1}}, lo; cvt.f32.f16 {s0}, h0; cvt.f32.f16 {s1}, h1;"
    " and.b32 x, hi, 0xff; cvt.rn.f32.u32 {z0}, x; shr.u32 x, hi, 8; and.b32 x, x, 0xff; cvt.rn.f32.u32 {z1}, x;"
)


def _chunk_asm(int4: bool = False, pre: bool = False) -> str:
    """A chunk's 8 groups of a 16-row tile in one block (pack 8). Operands: $0 / $8 the lane's sums
    of rows g / g + 8, $1..$7 / $9..$15 zero; $16 + k / $24 + k word t of group k for rows g /
    g + 8; $32, $40, $48, $56 the f16 pairs of the lane's own group (group g of the chunk: B's
    column g, so no shfl); $64 / $72 the rows' scales; $80 the fold factor 2^(14 + k) (MXFP4) or
    2^(24 + k) (int4); int4 also $88 the lane's own group's input sum times 2^-24 (the same f16
    inputs as B). Step k's product of group k is in column k only (the other columns multiply
    group k's weights by other groups' inputs), which lanes t = k // 2 hold (c0 / c2 for even k,
    c1 / c3 for odd): they add it times the group's scale (a predicated FMA), so lane t sums
    groups 2t and 2t + 1. MXFP4: the scales are the rows' 8 E8M0 bytes of the chunk. int4: as
    ``_SCALES_INT4`` reads them, and the sum starts at -s z Y for the lane's two groups (Y fetched
    from the lanes that own them), since the codes decode to q, not q - z.

    pre (int4 only): the words come decoded halfway (:func:`_predecode`, before moe_down's wait),
    two registers each: $16 + k / $24 + k w / w >> 8 of rows g, $32 + k / $40 + k of rows g + 8;
    the operands above from $32 on move up by 16."""
    if pre and not int4:
        raise ValueError("only int4 words come predecoded (MXFP4's moe_down decodes after its wait)")
    up = 16 if pre else 0
    b0s = [f"${32 + up + 8 * j}" for j in range(4)]
    es_a, es_b, fac, own = f"${64 + up}", f"${72 + up}", f"${80 + up}", f"${88 + up}"
    lines = [
        "{",
        ".reg .b32 a0, a1, a2, a3, x, y, z, t, sh, c0, c1, lo, hi, sel, za, ea, oa, eb, ob; .reg .b16 h0, h1;",
        ".reg .f32 d0, d1, d2, d3, sa0, sa1, sb0, sb1, acca, accb, y0, y1, z0, z1, z2, z3;",
        ".reg .pred p0, p1, p2, p3, hw;",
        _LANE,
    ]
    if int4:
        lines += [
            _SCALES_INT4.format(e=es_a, s0="sa0", s1="sa1", z0="z0", z1="z1"),
            _SCALES_INT4.format(e=es_b, s0="sb0", s1="sb1", z0="z2", z1="z3"),
            f"mul.f32 sa0, sa0, {fac}; mul.f32 sa1, sa1, {fac}; mul.f32 sb0, sb0, {fac}; mul.f32 sb1, sb1, {fac};",
            f"shl.b32 x, t, 3; shfl.sync.idx.b32 y, {own}, x, 0x1f, 0xffffffff; mov.b32 y0, y;",
            f"add.u32 x, x, 4; shfl.sync.idx.b32 y, {own}, x, 0x1f, 0xffffffff; mov.b32 y1, y;",
            "mul.f32 z0, z0, y0; mul.f32 z1, z1, y1; mul.f32 z2, z2, y0; mul.f32 z3, z3, y1;",
            "mul.f32 acca, sa0, z0; neg.f32 acca, acca; mul.f32 accb, sb0, z2; neg.f32 accb, accb;",
            "mul.f32 z1, sa1, z1; sub.f32 acca, acca, z1; mul.f32 z3, sb1, z3; sub.f32 accb, accb, z3;",
            "mov.b32 za, 0;",
        ]
    else:
        lines += [
            _SCALES.format(e=es_a, s0="sa0", s1="sa1"),
            _SCALES.format(e=es_b, s0="sb0", s1="sb1"),
            "mov.b32 za, 0; mov.b32 acca, 0; mov.b32 accb, 0;",
        ]
    for k in range(CHUNK):
        if pre:  # w, w >> 8 of rows g and of rows g + 8
            wa, xa, wb, xb = (f"${16 + 8 * j + k}" for j in range(4))
        else:
            wa, wb, xa, xb = f"${16 + k}", f"${24 + k}", "ea", "eb"
            ea, oa, eb, ob = "ea", "oa", "eb", "ob"
            lines.append(
                f"shr.u32 {xa}, {wa}, 8; shr.u32 {xb}, {wb}, 8;"
                if int4
                else _EO.format(w=wa, e="ea", o="oa") + " " + _EO.format(w=wb, e="eb", o="ob")
            )
        for tile, (b0, b1, c) in enumerate(((b0s[0], b0s[1], "za, za, za, za"), (b0s[2], b0s[3], "d0, d1, d2, d3"))):
            i = 2 * tile
            if int4:
                regs = ((wa, xa, i, "a0"), (wb, xb, i, "a1"), (wa, xa, i + 1, "a2"), (wb, xb, i + 1, "a3"))
                lines.append(" ".join(_pair_int4(n, w, w8, a) for w, w8, n, a in regs))
            else:
                regs4 = (
                    (ea, oa, i, "a0"),
                    (eb, ob, i, "a1"),
                    (ea, oa, i + 1, "a2"),
                    (eb, ob, i + 1, "a3"),
                )
                lines.append(" ".join(_pair(n, e, o, a) for e, o, n, a in regs4))
            lines.append(_MMA.format(b0=b0, b1=b1, c=c))
        d = ("d0", "d2", "sa0", "sb0") if k % 2 == 0 else ("d1", "d3", "sa1", "sb1")
        p = f"p{k // 2}"
        lines.append(f"@{p} fma.rn.f32 acca, {d[0]}, {d[2]}, acca; @{p} fma.rn.f32 accb, {d[1]}, {d[3]}, accb;")
    if int4:
        lines.append("mov.b32 $0, acca; mov.b32 $8, accb;")
    else:
        lines.append(f"mul.f32 $0, acca, {fac}; mul.f32 $8, accb, {fac};")
    lines.append(" ".join(f"mov.b32 ${i}, 0;" for i in (*range(1, 8), *range(9, 16))))
    return "\n".join((*lines, "}"))


CHUNK_ASM = tl.constexpr(_chunk_asm())
CHUNK_CONSTRAINTS = tl.constexpr(",".join(["=f"] * 16 + ["r"] * 48 + ["l"] * 16 + ["f"] * 8))
CHUNK_ASM_INT4 = tl.constexpr(_chunk_asm(int4=True))
CHUNK_CONSTRAINTS_INT4 = tl.constexpr(",".join(["=f"] * 16 + ["r"] * 48 + ["l"] * 16 + ["f"] * 16))
CHUNK_ASM_INT4_PRE = tl.constexpr(_chunk_asm(int4=True, pre=True))
CHUNK_CONSTRAINTS_INT4_PRE = tl.constexpr(",".join(["=f"] * 16 + ["r"] * 64 + ["l"] * 16 + ["f"] * 16))
# 8 inputs x[4i + t] (i = 0..7, bf16 or f16) -> 4 f16 pairs (x[4i + t], x[4i + 16 + t]) x scale: pairs 0 and 2
# times $12, 1 and 3 times $13 (int4: $12 / 16, as they meet its codes 16 q)
_PACK = """{{
    .reg .f32 f0, f1;
    cvt.f32.{t} f0, $4; cvt.f32.{t} f1, $8;  mul.f32 f0, f0, $12; mul.f32 f1, f1, $12; cvt.rn.f16x2.f32 $0, f1, f0;
    cvt.f32.{t} f0, $5; cvt.f32.{t} f1, $9;  mul.f32 f0, f0, $13; mul.f32 f1, f1, $13; cvt.rn.f16x2.f32 $1, f1, f0;
    cvt.f32.{t} f0, $6; cvt.f32.{t} f1, $10; mul.f32 f0, f0, $12; mul.f32 f1, f1, $12; cvt.rn.f16x2.f32 $2, f1, f0;
    cvt.f32.{t} f0, $7; cvt.f32.{t} f1, $11; mul.f32 f0, f0, $13; mul.f32 f1, f1, $13; cvt.rn.f16x2.f32 $3, f1, f0;
}}"""
PACK_BF16 = tl.constexpr(_PACK.format(t="bf16"))
PACK_F16 = tl.constexpr(_PACK.format(t="f16"))
# the same from activations stored t-major (``t_major``: x'[8t + i] = x[4i + t] in each group of
# 32), as the lane's 4 words w_j = (x'[8t + 2j], x'[8t + 2j + 1]) = (x[8j + t], x[8j + 4 + t]):
# pair i = (x[4i + t], x[4i + 16 + t]) is half i % 2 of w_(i / 2) and of w_(i / 2 + 2)
_PACK_W = """{{
    .reg .f32 f0, f1; .reg .b16 a0, a1, a2, a3, b0, b1, b2, b3;
    mov.b32 {{a0, a1}}, $4; mov.b32 {{a2, a3}}, $5; mov.b32 {{b0, b1}}, $6; mov.b32 {{b2, b3}}, $7;
    cvt.f32.{t} f0, a0; cvt.f32.{t} f1, b0; mul.f32 f0, f0, $8; mul.f32 f1, f1, $8; cvt.rn.f16x2.f32 $0, f1, f0;
    cvt.f32.{t} f0, a1; cvt.f32.{t} f1, b1; mul.f32 f0, f0, $9; mul.f32 f1, f1, $9; cvt.rn.f16x2.f32 $1, f1, f0;
    cvt.f32.{t} f0, a2; cvt.f32.{t} f1, b2; mul.f32 f0, f0, $8; mul.f32 f1, f1, $8; cvt.rn.f16x2.f32 $2, f1, f0;
    cvt.f32.{t} f0, a3; cvt.f32.{t} f1, b3; mul.f32 f0, f0, $9; mul.f32 f1, f1, $9; cvt.rn.f16x2.f32 $3, f1, f0;
}}"""
PACK_W_BF16 = tl.constexpr(_PACK_W.format(t="bf16"))
PACK_W_F16 = tl.constexpr(_PACK_W.format(t="f16"))
# the largest |x| of a lane's 4 words (8 bf16 / f16 inputs) as bits, as ``_magnitude`` computes it
MAGNITUDE_W = tl.constexpr("""{
    .reg .b32 m, n; .reg .b16 lo, hi;
    and.b32 m, $1, 0x7fff7fff; and.b32 n, $2, 0x7fff7fff; max.u16x2 m, m, n;
    and.b32 n, $3, 0x7fff7fff; max.u16x2 m, m, n; and.b32 n, $4, 0x7fff7fff; max.u16x2 m, m, n;
    mov.b32 {lo, hi}, m; max.u16 lo, lo, hi; cvt.u32.u16 $0, lo;
}""")


# the sum of a lane's 4 words (8 bf16 / f16 inputs) in float32
_SUM_W = """{{
    .reg .f32 f, g, acc; .reg .b16 a, b;
    mov.b32 {{a, b}}, $1; cvt.f32.{t} f, a; cvt.f32.{t} g, b; add.f32 acc, f, g;
    mov.b32 {{a, b}}, $2; cvt.f32.{t} f, a; cvt.f32.{t} g, b; add.f32 acc, acc, f; add.f32 acc, acc, g;
    mov.b32 {{a, b}}, $3; cvt.f32.{t} f, a; cvt.f32.{t} g, b; add.f32 acc, acc, f; add.f32 acc, acc, g;
    mov.b32 {{a, b}}, $4; cvt.f32.{t} f, a; cvt.f32.{t} g, b; add.f32 acc, acc, f; add.f32 $0, acc, g;
}}"""
SUM_W_BF16 = tl.constexpr(_SUM_W.format(t="bf16"))
SUM_W_F16 = tl.constexpr(_SUM_W.format(t="f16"))
# the largest of a 32-bit value over the warp's lanes, in every lane: one instruction in place of five
# shuffle-and-max rounds on the path from the inputs to the first MMA
WARP_MAX = tl.constexpr("redux.sync.max.s32 $0, $1, 0xffffffff;")
# p: a predicate of $1 that is always true but not foldable (see _after), y = $1^2 + 1
_ALWAYS = "{ .reg .pred p; .reg .b32 y; mul.lo.u32 y, $1, $1; add.u32 y, y, 1; setp.ne.u32 p, y, 0;"
WAIT_AFTER = tl.constexpr(_ALWAYS + " @p griddepcontrol.wait; and.b32 $0, y, 0; }")
ZERO_AFTER = tl.constexpr(_ALWAYS + " selp.b32 $0, 0, 1, p; }")
# in the PTX of this module's kernels (a comment by a dead move): the PTX pass rewrites only those
WARP_BARRIERS_MARK = "// modelfleet: warp-local conversions"
WARP_BARRIERS_ASM = tl.constexpr("mov.u32 $0, 0; " + WARP_BARRIERS_MARK)

_STORE = re.compile(r"^\s*st\.shared\.v4\.b32\s+\[([^\]]+)\],")
_LDMATRIX = re.compile(r"^\s*ldmatrix\.sync\.aligned\.m8n8\.x4\.shared\.b16\s+\{[^}]*\},\s*\[([^\]]+)\];")
_WARP_SYNC = re.compile(r"^\s*bar\.warp\.sync\s+-1;")
_CTA_SYNC = re.compile(r"^(\s*)bar\.sync\s+0;\s*$")
_SHARED = re.compile(r"shared|bar\.|barrier|fence|matrix|cp\.async")


def warp_barriers(ptx: str) -> tuple[str, int]:
    """``ptx`` with each CTA barrier (``bar.sync 0``) that only guards a warp-local conversion's
    scratch against the same conversion's next use made a warp barrier (``bar.warp.sync``), and
    how many. A warp-local conversion, as Triton lowers one: 16-byte shared stores, a warp sync,
    ldmatrix loads (no CTA barrier between: each warp reads back only what it wrote). The barrier
    is rewritten only where the shared-memory operations just before it are one such conversion's
    loads and those just after it the stores of a conversion at the same addresses (the same
    registers, defined once): each warp then overwrites only what it itself read, which the warp
    barrier orders. Every other barrier stays."""
    lines = ptx.split("\n")
    events: list[tuple[str, int, str]] = []  # (kind, line, address) of every shared-memory operation
    for i, line in enumerate(lines):
        for kind, pattern in (("st", _STORE), ("ld", _LDMATRIX), ("warp", _WARP_SYNC), ("cta", _CTA_SYNC)):
            m = pattern.match(line)
            if m:
                events.append((kind, i, m.group(1) if kind in ("st", "ld") else ""))
                break
        else:
            if _SHARED.search(line.split("//")[0]):
                events.append(("other", i, ""))
    # conversions: stores, one warp sync, loads; keyed by their first and last event
    ends: dict[int, tuple[tuple[str, ...], tuple[str, ...]]] = {}
    starts: dict[int, tuple[tuple[str, ...], tuple[str, ...]]] = {}
    e = 0
    while e < len(events):
        first = e
        while e < len(events) and events[e][0] == "st":
            e += 1
        stores = tuple(a for _, _, a in events[first:e])
        if stores and e < len(events) and events[e][0] == "warp":
            after = e + 1
            e = after
            while e < len(events) and events[e][0] == "ld":
                e += 1
            loads = tuple(a for _, _, a in events[after:e])
            if loads:
                starts[first] = ends[e - 1] = (stores, loads)
            continue
        e = max(e, first + 1)
    rewritten = 0
    for e, (kind, i, _) in enumerate(events):
        if kind == "cta" and e - 1 in ends and e + 1 in starts and ends[e - 1] == starts[e + 1]:
            indent = _CTA_SYNC.match(lines[i]).group(1)  # type: ignore[union-attr]
            lines[i] = f"{indent}bar.warp.sync \t-1;"
            rewritten += 1
    return "\n".join(lines), rewritten


def _add_warp_barriers_pass(stages: dict[str, Callable[[Any, Any], Any]]) -> None:
    """The PTX stage followed by :func:`warp_barriers` for the kernels marked so."""
    make_ptx = stages.get("ptx")
    if make_ptx is None:  # pragma: no cover - another backend
        return

    def ptx_stage(src: Any, metadata: Any) -> Any:
        ptx = make_ptx(src, metadata)
        return warp_barriers(ptx)[0] if WARP_BARRIERS_MARK in ptx else ptx

    stages["ptx"] = ptx_stage


_ptx_pass_installed = False


def install_ptx_pass() -> None:
    """Adds :func:`warp_barriers` to Triton's pipeline (its stages hook, chained after any hook set
    before), once per process; :func:`moe_up` and :func:`moe_down` call it before they launch. Only
    this module's kernels carry the mark the pass looks for. Triton's disk cache does not key on
    the hook: a kernel compiled before the pass is installed (launched other than through those
    two) would be cached with Triton's barriers. Triton without the hook: no pass, the kernels keep
    Triton's barriers."""
    global _ptx_pass_installed
    if _ptx_pass_installed:
        return
    from triton import knobs

    _ptx_pass_installed = True
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "add_stages_inspection_hook"):  # pragma: no cover
        return
    before = runtime.add_stages_inspection_hook
    if getattr(before, "modelfleet_warp_barriers", False):  # another copy of this module installed it
        return

    def hook(*args: Any) -> None:  # (backend,) stages, options, language, capability
        if before is not None:
            before(*args)
        _add_warp_barriers_pass(next(a for a in args if isinstance(a, dict)))

    hook.modelfleet_warp_barriers = True  # type: ignore[attr-defined]
    runtime.add_stages_inspection_hook = hook


if gluon is not None:

    @gluon.jit
    def _warp_barriers_mark():
        """Marks the kernel's PTX for :func:`warp_barriers` (a comment; the register is dead)."""
        gl.inline_asm_elementwise(WARP_BARRIERS_ASM, "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _gdc_wait():
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _after(x, ASM: gl.constexpr, PURE: gl.constexpr = False):
        """ASM under a predicate p of x that is always true (x^2 + 1 is never 0 mod 2^32) but that
        ptxas cannot fold, so what x depends on stays before it."""
        return gl.inline_asm_elementwise(ASM, "=r,r", [x], dtype=gl.int32, is_pure=PURE, pack=1)

    @gluon.jit
    def _gdc_wait_after(x):
        """griddepcontrol.wait once x is computed (:func:`_after`); returns 0."""
        return _after(x, WAIT_AFTER)

    @gluon.jit
    def _zero_after(x):
        """0, once x is loaded (:func:`_after`)."""
        return _after(x, ZERO_AFTER, True)

    @gluon.jit
    def _warp_max(m):
        """The warp's largest m (int32) in each of its elements (one per lane: [W, 8, 1, 4] in the
        kernels' fragment layout, whose 32 lanes are its (g, t))."""
        return gl.inline_asm_elementwise(WARP_MAX, "=r,r", [m], dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _xor(a, b):
        return a ^ b

    @gluon.jit
    def _gdc_launch_dependents():
        gl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )

    @gluon.jit
    def _axes(W: gl.constexpr, L: gl.constexpr):
        """aranges along the 4 dims of L: [W, 1, 1, 1], [1, 8, 1, 1], [1, 1, GC, 1], [1, 1, 1, 4]."""
        a0 = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L))))
        a1 = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, L))))
        a2 = gl.arange(0, GC, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L))))
        a3 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L))))
        w = gl.expand_dims(gl.expand_dims(gl.expand_dims(a0, 1), 2), 3)
        g = gl.expand_dims(gl.expand_dims(gl.expand_dims(a1, 0), 2), 3)
        q = gl.expand_dims(gl.expand_dims(gl.expand_dims(a2, 0), 1), 3)
        t = gl.expand_dims(gl.expand_dims(gl.expand_dims(a3, 0), 1), 2)
        return w, g, q, t

    @gluon.jit
    def _inputs(x_at, ok):
        """The 8 inputs x[4i + t] of the lane's own group (x_at: its group's input t; 0 past the
        last group)."""
        return (
            gl.load(x_at, mask=ok, other=0.0), gl.load(x_at + 4, mask=ok, other=0.0),
            gl.load(x_at + 8, mask=ok, other=0.0), gl.load(x_at + 12, mask=ok, other=0.0),
            gl.load(x_at + 16, mask=ok, other=0.0), gl.load(x_at + 20, mask=ok, other=0.0),
            gl.load(x_at + 24, mask=ok, other=0.0), gl.load(x_at + 28, mask=ok, other=0.0),
        )  # fmt: skip

    @gluon.jit
    def _input_words(at, ok):
        """The lane's 4 words of t-major inputs (at: an int64 pointer to x'[8t] of its group; 0 past
        the last group): two 8-byte loads instead of eight 2-byte ones."""
        v0 = gl.load(at, mask=ok, other=0)
        v1 = gl.load(at + 1, mask=ok, other=0)
        return (v0.to(gl.int32), (v0 >> 32).to(gl.int32), v1.to(gl.int32), (v1 >> 32).to(gl.int32))

    @gluon.jit
    def _magnitude(xs, F16: gl.constexpr):
        """The largest |x| of the 8 inputs as its bits (ordered as integers), exponent at bit 7
        (bf16) or 10 (f16). bf16: each sign shifted out (an IMAD, off the integer pipe that the
        decode keeps busy) rather than masked off (f16 keeps the mask: the shift costs int4's
        moe_up registers)."""
        if F16:
            m = xs[0].to(gl.int16, bitcast=True).to(gl.int32) & 0x7FFF
            for i in gl.static_range(1, 8):
                m = gl.maximum(m, xs[i].to(gl.int16, bitcast=True).to(gl.int32) & 0x7FFF)
            return m
        m = (xs[0].to(gl.int16, bitcast=True).to(gl.int32) << 17).to(gl.uint32, bitcast=True)
        for i in gl.static_range(1, 8):
            m = gl.maximum(m, (xs[i].to(gl.int16, bitcast=True).to(gl.int32) << 17).to(gl.uint32, bitcast=True))
        return (m >> 17).to(gl.int32, bitcast=True)

    @gluon.jit
    def _input_scale(m, F16: gl.constexpr, INT4: gl.constexpr):
        """2^-k and 2^(14 + k) (float32; int4: 2^(24 + k), its codes being q x 2^-24). MXFP4: k the
        smallest shift >= 0 that keeps |x| 2^-k below 2^15 (f16 inputs: 0, finite f16 already).
        int4: k putting the warp's largest |x| x 2^-k in [2^14, 2^15) (k >= -100), small inputs
        scaled up, so that only inputs 2^24 below the largest lose bits as f16 subnormals where B
        holds them / 16."""
        if INT4:
            k = gl.maximum((m >> 10) - 29 if F16 else (m >> 7) - 141, -100)
        else:
            k = m * 0 if F16 else gl.maximum((m >> 7) - 141, 0)
        return ((127 - k) << 23).to(gl.float32, bitcast=True), ((141 + 10 * INT4 + k) << 23).to(
            gl.float32, bitcast=True
        )

    @gluon.jit
    def _input_sum(xs, WORDS: gl.constexpr, F16: gl.constexpr):
        """The sum of a lane's 8 inputs (float32), as loaded (WORDS: :func:`_input_words`)."""
        if WORDS:
            total = gl.inline_asm_elementwise(
                SUM_W_F16 if F16 else SUM_W_BF16, "=f,r,r,r,r", [xs[0], xs[1], xs[2], xs[3]],
                dtype=gl.float32, is_pure=True, pack=1,
            )  # fmt: skip
        else:
            total = xs[0].to(gl.float32)
            for i in gl.static_range(1, 8):
                total += xs[i].to(gl.float32)
        return total

    @gluon.jit
    def _magnitude_of_words(ws):
        return gl.inline_asm_elementwise(
            MAGNITUDE_W, "=r,r,r,r,r", [ws[0], ws[1], ws[2], ws[3]], dtype=gl.int32, is_pure=True, pack=1
        )

    @gluon.jit
    def _pack_words(ws, scale, odd, F16: gl.constexpr):
        return gl.inline_asm_elementwise(
            PACK_W_F16 if F16 else PACK_W_BF16, "=r,=r,=r,=r,r,r,r,r,f,f", [ws[0], ws[1], ws[2], ws[3], scale, odd],
            dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1,
        )  # fmt: skip

    @gluon.jit
    def _pack(xs, scale, odd, F16: gl.constexpr):
        ins = [xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6], xs[7], scale, odd]
        return gl.inline_asm_elementwise(
            PACK_F16 if F16 else PACK_BF16, "=r,=r,=r,=r,h,h,h,h,h,h,h,h,f,f", ins,
            dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1,
        )  # fmt: skip

    @gluon.jit
    def _load_as(at, ty: gl.constexpr, mask, EVICT: gl.constexpr):
        """The ty at pointer at, whatever its element type (0 where not mask), with eviction policy EVICT."""
        return gl.load(at.to(gl.pointer_type(ty), bitcast=True), mask=mask, other=0, eviction_policy=EVICT)

    @gluon.jit
    def _chunk_loads(
        at, b_words, rows, a8, b8, zrows, zb, t, lgg, x_at, x_group,
        G: gl.constexpr, CHUNKS: gl.constexpr, WITH_X: gl.constexpr, INT4: gl.constexpr, SYM: gl.constexpr,
        STAGGER: gl.constexpr = False, SCALES_EVICT: gl.constexpr = "",
    ):  # fmt: skip
        """Every chunk's code words (rows a at ``at``, rows b ``b_words`` further) and scales, as
        the chunk asm takes them. MXFP4: per lane an int64 whose bytes 2t and 2t + 1 are its rows'
        scales of groups 2t and 2t + 1 of the chunk (rows: the rows' scales, rows a a8 and b b8
        further, a8 also the group of the first). Rows of whole chunks (G % 8 == 0) load their 8
        bytes at once; else the lane loads its 2 bytes (0 past the last group, as are the codes).
        int4 (G even): the two fp16 scales in one 4-byte load and, above them, the two zero points
        (zrows: the rows' zero points, rows b zb further; SYM: 8). lgg: the loads' groups of
        chunk 0. WITH_X: also each chunk's inputs of the lane's own group (x_at, x_group: its
        input t and group in chunk 0). SCALES_EVICT: the scales' and zero points' eviction policy."""
        ws_a = ()
        ws_b = ()
        es_a = ()
        es_b = ()
        xss = ()
        s8 = rows.to(gl.pointer_type(gl.int64), bitcast=True)
        for c in gl.static_range(CHUNKS):
            ok = lgg + c * GC < G
            if STAGGER and c > 0:  # chunk c's code loads issued once chunk c - 1's first word is in
                # (x 64: a multiple of 16 bytes, so the loads stay 16 bytes wide)
                at = at + _zero_after(gl.reduce(ws_a[c - 1], 3, _first, keep_dims=True)) * 64
            # the codes are read once per step: first out of L1 and L2
            ws_a = ws_a + (gl.load(at + c * GC * 4, mask=ok, other=0, eviction_policy="evict_first"),)
            ws_b = ws_b + (gl.load(at + b_words + c * GC * 4, mask=ok, other=0, eviction_policy="evict_first"),)
            k = c * GC + 2 * t  # the lane's first group of the chunk, from a8
            if INT4:
                pair = a8 + k < G
                sa = _load_as(rows + a8 + k, gl.int32, pair, SCALES_EVICT)
                sb = _load_as(rows + b8 + k, gl.int32, pair, SCALES_EVICT)
                if SYM:
                    za = sa * 0 + 0x0808
                    zb_ = za
                else:
                    za = _load_as(zrows + a8 + k, gl.int16, pair, SCALES_EVICT)
                    zb_ = _load_as(zrows + zb + k, gl.int16, pair, SCALES_EVICT)
                low = 0xFFFFFFFF
                es_a = es_a + ((sa.to(gl.int64) & low) | (za.to(gl.int64) & 0xFFFF) << 32,)
                es_b = es_b + ((sb.to(gl.int64) & low) | (zb_.to(gl.int64) & 0xFFFF) << 32,)
            elif G % GC == 0:
                es_a = es_a + (gl.load(s8 + (a8 + c * GC) // 8, eviction_policy=SCALES_EVICT),)
                es_b = es_b + (gl.load(s8 + (b8 + c * GC) // 8, eviction_policy=SCALES_EVICT),)
            else:
                sb8 = rows.to(gl.pointer_type(gl.uint8), bitcast=True)
                at_a, at_b, first, second = sb8 + a8 + k, sb8 + b8 + k, a8 + k < G, a8 + k + 1 < G
                ea = (
                    gl.load(at_a, mask=first, other=0, eviction_policy=SCALES_EVICT).to(gl.int64)
                    | gl.load(at_a + 1, mask=second, other=0, eviction_policy=SCALES_EVICT).to(gl.int64) << 8
                )
                eb = (
                    gl.load(at_b, mask=first, other=0, eviction_policy=SCALES_EVICT).to(gl.int64)
                    | gl.load(at_b + 1, mask=second, other=0, eviction_policy=SCALES_EVICT).to(gl.int64) << 8
                )
                es_a = es_a + (ea << (16 * t).to(gl.int64),)
                es_b = es_b + (eb << (16 * t).to(gl.int64),)
            if WITH_X:
                xss = xss + (_inputs(x_at + c * GC * 32, x_group + c * GC < G),)
        return ws_a, ws_b, es_a, es_b, xss

    @gluon.jit
    def _predecode(w):
        """A chunk's converted int4 words halfway decoded, for ``_chunk_asm(int4=True, pre=True)``:
        the word and the word >> 8 (the shift the ANDs share)."""
        return w, w >> 8  # arithmetic: the sign-filled bits are masked off

    @gluon.jit
    def _first(a, b):
        """Combine for taking a chunk's sums from the asm's first output (the other 7 are zero)."""
        return a

    @gluon.jit
    def _tile_sums(
        wss_a, wss_b, ess_a, ess_b, xss, w, g, gi, t,
        CHUNKS: gl.constexpr, F16: gl.constexpr, LF: gl.constexpr, WORDS: gl.constexpr, INT4: gl.constexpr,
        TILES: gl.constexpr, PRE: gl.constexpr = 0,
    ):  # fmt: skip
        """Rows g and g + 8 of each of a warp's TILES 16-row tiles summed over its CHUNKS chunks of
        groups ([W, 8, 1, 4] each, a tuple per tile): wss_*[j] tile j's chunks' code words as
        loaded (converted here to lane (g, t)'s words; int4: the first PRE chunks already converted
        and halfway decoded, a pair each, :func:`_predecode`), ess_*[j] its rows' scales (as
        :func:`_chunk_loads` gives them), xss the lane's own group's inputs per chunk (WORDS: as
        :func:`_input_words` loads them), shared by the tiles: packed into B once per chunk."""
        if WORDS:
            m = _magnitude_of_words(xss[0])
            for c in gl.static_range(1, CHUNKS):
                m = gl.maximum(m, _magnitude_of_words(xss[c]))
        else:
            m = _magnitude(xss[0], F16)
            for c in gl.static_range(1, CHUNKS):
                m = gl.maximum(m, _magnitude(xss[c], F16))
        m = _warp_max(m)
        xscale, fac = _input_scale(m, F16, INT4)
        xscale = xscale + 0.0 * (g + t)
        fac = fac + 0.0 * (g + gi + t)
        ps = ()
        owns = ()
        for c in gl.static_range(CHUNKS):
            odd = xscale * 0.0625 if INT4 else xscale  # int4: pairs 1 and 3 meet 16 q
            ps = ps + (_pack_words(xss[c], xscale, odd, F16) if WORDS else _pack(xss[c], xscale, odd, F16),)
            if INT4:  # the lane's own group's input sum, in the units of B times 2^-24
                own = gl.sum(_input_sum(xss[c], WORDS, F16), axis=3, keep_dims=True) * xscale * 5.9604644775390625e-08
                owns = owns + (own + 0.0 * fac,)
        accs_a = ()
        accs_b = ()
        for j in gl.static_range(TILES):
            for c in gl.static_range(CHUNKS):
                p = ps[c]
                if c < PRE:
                    ha = wss_a[j][c]
                    hb = wss_b[j][c]
                    ins = [ha[0], ha[1], hb[0], hb[1], p[0], p[1], p[2], p[3], ess_a[j][c], ess_b[j][c], fac]
                else:
                    wa = gl.convert_layout(wss_a[j][c], LF)
                    wb = gl.convert_layout(wss_b[j][c], LF)
                    ins = [wa, wb, p[0], p[1], p[2], p[3], ess_a[j][c], ess_b[j][c], fac]
                if c < PRE:  # int4 only
                    pa, pb = gl.inline_asm_elementwise(
                        CHUNK_ASM_INT4_PRE, CHUNK_CONSTRAINTS_INT4_PRE, ins + [owns[c]],
                        dtype=(gl.float32, gl.float32), is_pure=True, pack=8,
                    )  # fmt: skip
                elif INT4:
                    pa, pb = gl.inline_asm_elementwise(
                        CHUNK_ASM_INT4, CHUNK_CONSTRAINTS_INT4, ins + [owns[c]], dtype=(gl.float32, gl.float32),
                        is_pure=True, pack=8,
                    )  # fmt: skip
                else:
                    pa, pb = gl.inline_asm_elementwise(
                        CHUNK_ASM, CHUNK_CONSTRAINTS, ins, dtype=(gl.float32, gl.float32), is_pure=True, pack=8
                    )
                if c == 0:
                    acc_a = gl.reduce(pa, 2, _first, keep_dims=True)
                    acc_b = gl.reduce(pb, 2, _first, keep_dims=True)
                else:
                    acc_a += gl.reduce(pa, 2, _first, keep_dims=True)
                    acc_b += gl.reduce(pb, 2, _first, keep_dims=True)
            # lane t holds groups 2t and 2t + 1 of each chunk: every lane of the row gets the row's sum
            accs_a = accs_a + (gl.sum(acc_a, axis=3, keep_dims=True) + 0.0 * t,)
            accs_b = accs_b + (gl.sum(acc_b, axis=3, keep_dims=True) + 0.0 * t,)
        return accs_a, accs_b

    @gluon.jit
    def _act(gate, up, alpha, limit, ACT: gl.constexpr):
        if ACT == 1:
            return gate / (1.0 + gl.exp(-gate)) * up
        gate = gl.minimum(gate, limit)
        up = gl.minimum(gl.maximum(up, -limit), limit)
        return (up + 1.0) * gate / (1.0 + gl.exp(-alpha * gate))

    @gluon.jit
    def _mma_up_kernel(
        x_ptr, codes_ptr, scales_ptr, zeros_ptr, index_ptr, bias_ptr, out_ptr, I, alpha, limit,
        stride_xm, stride_ce, stride_cn, stride_se, stride_sn, stride_ze, stride_zn, stride_be, stride_om,
        TOP_K: gl.constexpr, G: gl.constexpr, CHW: gl.constexpr, WARPS: gl.constexpr, TILES: gl.constexpr,
        ACT: gl.constexpr, HAS_BIAS: gl.constexpr, F16: gl.constexpr, PDL: gl.constexpr, T_MAJOR: gl.constexpr,
        INT4: gl.constexpr, SYM: gl.constexpr, STAGGER: gl.constexpr = False, SCALES_EVICT: gl.constexpr = "",
        ROWS_FIRST: gl.constexpr = False,
    ):  # fmt: skip
        """Program (pair, TILES x 8 intermediate rows): tile j's rows g = gate rows 8 (TILES mt +
        j) + g, rows g + 8 = the same up rows; WARPS warps split the G groups, CHW chunks of 8 each
        (the last may run past G: masked), each warp computing its chunks of all TILES tiles with
        the inputs packed once. T_MAJOR: activations stored t-major (see :func:`t_major`). STAGGER:
        chunk c's code loads wait for chunk c - 1's first word. ROWS_FIRST: the grid is (row tiles,
        pairs), so consecutive programs read one expert's consecutive rows."""
        GW: gl.constexpr = CHW * GC  # groups per warp
        LF: gl.constexpr = gl.BlockedLayout([1, 1, GC, 1], [1, 8, 1, 4], [WARPS, 1, 1, 1], [3, 1, 2, 0])
        LL: gl.constexpr = gl.BlockedLayout([1, 1, 1, 4], [1, 4, 8, 1], [WARPS, 1, 1, 1], [3, 2, 1, 0])
        _warp_barriers_mark()
        pair = gl.program_id(1 if ROWS_FIRST else 0)
        mt = gl.program_id(0 if ROWS_FIRST else 1)
        if PDL:  # x and index come from the kernels before; moe_down may start loading its codes
            _gdc_wait()
            _gdc_launch_dependents()
        expert = gl.load(index_ptr + pair).to(gl.int64)
        lw, lg, lq, lj = _axes(WARPS, LL)  # loads: whole groups, 128 contiguous bytes per row
        lgg = lw * GW + lq  # [W, 1, GC, 1]: the load's groups of chunk 0
        w, g, gi, t = _axes(WARPS, LF)
        g0 = w * GW
        x_at = x_ptr + (pair // TOP_K) * stride_xm + (g0 + g) * 32 + t
        wss_g = ()
        wss_u = ()
        ess_g = ()
        ess_u = ()
        for j in gl.static_range(TILES):  # every load before the first decode: the up rows are I rows further
            r0 = (mt * TILES + j) * 8
            at = codes_ptr + expert * stride_ce + (r0 + lg) * stride_cn + lgg * 4 + lj
            rows = scales_ptr + expert * stride_se + (r0 + g) * stride_sn
            zrows = zeros_ptr + expert * stride_ze + (r0 + g) * stride_zn
            ws_g, ws_u, es_g, es_u, xs = _chunk_loads(
                at, I * stride_cn, rows, g0, I * stride_sn + g0, zrows, I * stride_zn + g0, t, lgg, x_at, g0 + g,
                G, CHW, j == 0, INT4, SYM, STAGGER, SCALES_EVICT,
            )  # fmt: skip
            if j == 0:
                xss = xs
            wss_g = wss_g + (ws_g,)
            wss_u = wss_u + (ws_u,)
            ess_g = ess_g + (es_g,)
            ess_u = ess_u + (es_u,)
        accs_g, accs_u = _tile_sums(wss_g, wss_u, ess_g, ess_u, xss, w, g, gi, t, CHW, F16, LF, False, INT4, TILES)
        lead = gl.sum(t, axis=0) == 0
        lg = gl.sum(g, axis=0) + gl.sum(t, axis=0) * 0  # [8, 1, 4]: lanes (g, t) hold gate / up row 8 tile + g
        for j in gl.static_range(TILES):
            tile = mt * TILES + j
            gate = gl.sum(accs_g[j], axis=0)
            up = gl.sum(accs_u[j], axis=0)
            row = tile * 8 + lg
            if HAS_BIAS:
                gate += gl.load(bias_ptr + expert * stride_be + row).to(gl.float32)
                up += gl.load(bias_ptr + expert * stride_be + I + row).to(gl.float32)
            a = _act(gate, up, alpha, limit, ACT)
            if T_MAJOR:  # row n = 32 q + 4 i + t of a group goes to 32 q + 8 t + i (8 tile: a multiple of 8)
                row = (tile // 4) * 32 + (lg % 4) * 8 + (tile % 4) * 2 + lg // 4
            gl.store(out_ptr + pair * stride_om + row, a.to(out_ptr.dtype.element_ty), mask=lead)

    @gluon.jit
    def _mma_down_kernel(
        a_ptr, codes_ptr, scales_ptr, zeros_ptr, index_ptr, weight_ptr, bias_ptr, out_ptr,
        stride_am, stride_ce, stride_cn, stride_se, stride_sn, stride_ze, stride_zn, stride_be, stride_wt, stride_om,
        TOP_K: gl.constexpr, G: gl.constexpr, HAS_BIAS: gl.constexpr, F16: gl.constexpr, PDL: gl.constexpr,
        T_MAJOR: gl.constexpr, INT4: gl.constexpr, SYM: gl.constexpr, PRE: gl.constexpr,
        SCALES_EVICT: gl.constexpr = "",
    ):  # fmt: skip
        """Program (token, 16 output rows); warp k = the token's pair k, summed across warps.
        T_MAJOR: the activations come t-major (two 8-byte loads per lane and chunk). PRE (int4
        only): how many chunks are converted to fragment order and halfway decoded before the wait
        (:func:`_predecode`; the rest after it)."""
        LF: gl.constexpr = gl.BlockedLayout([1, 1, GC, 1], [1, 8, 1, 4], [TOP_K, 1, 1, 1], [3, 1, 2, 0])
        LL: gl.constexpr = gl.BlockedLayout([1, 1, 1, 4], [1, 4, 8, 1], [TOP_K, 1, 1, 1], [3, 2, 1, 0])
        _warp_barriers_mark()
        token = gl.program_id(0)
        mt = gl.program_id(1)
        CH: gl.constexpr = (G + GC - 1) // GC  # chunks (the last may run past G: masked)
        lk, lg, lq, lj = _axes(TOP_K, LL)
        l_expert = gl.load(index_ptr + token * TOP_K + lk).to(gl.int64)
        at = codes_ptr + l_expert * stride_ce + (mt * 16 + lg) * stride_cn + lq * 4 + lj
        k, g, gi, t = _axes(TOP_K, LF)
        pair = token * TOP_K + k
        expert = gl.load(index_ptr + pair).to(gl.int64)
        rows = scales_ptr + expert * stride_se + (mt * 16 + g) * stride_sn
        zrows = zeros_ptr + expert * stride_ze + (mt * 16 + g) * stride_zn
        ws_g, ws_h, es_g, es_h, _ = _chunk_loads(
            at, 8 * stride_cn, rows, 0, 8 * stride_sn, zrows, 8 * stride_zn, t, lq, rows, 0, G, CH, False, INT4, SYM,
            False, SCALES_EVICT,
        )  # fmt: skip  # every code word in flight before the wait: rows g + 8 are 8 rows further
        if PRE > 0:  # converted and halfway decoded while moe_up finishes
            pre_g = ()
            pre_h = ()
            for c in gl.static_range(CH):
                if c < PRE:
                    pre_g = pre_g + (_predecode(gl.convert_layout(ws_g[c], LF)),)
                    pre_h = pre_h + (_predecode(gl.convert_layout(ws_h[c], LF)),)
                else:
                    pre_g = pre_g + (ws_g[c],)
                    pre_h = pre_h + (ws_h[c],)
            ws_g = pre_g
            ws_h = pre_h
        after = g * 0  # PRE: the wait's 0, added to the activations' addresses so no load moves above it
        # the wait made to depend on every halfway-decoded word, so ptxas keeps the decode before it
        if PDL and PRE > 0:
            mix = ws_g[0][0]
            NPRE: gl.constexpr = PRE if PRE < CH else CH
            for c in gl.static_range(NPRE):
                for half in gl.static_range(2):
                    if c + half > 0:
                        mix = mix ^ ws_g[c][half]
                    mix = mix ^ ws_h[c][half]
            after = gl.expand_dims(_gdc_wait_after(gl.reduce(mix, 2, _xor)), 2)
        elif PDL:  # the activations are moe_up's output
            _gdc_wait()
        xss = ()
        if T_MAJOR:
            a_at = (a_ptr + pair * stride_am + g * 32 + 8 * t + after).to(gl.pointer_type(gl.int64), bitcast=True)
            for c in gl.static_range(CH):
                xss = xss + (_input_words(a_at + c * GC * 8, g + c * GC < G),)
        else:
            a_at = a_ptr + pair * stride_am + g * 32 + t + after
            for c in gl.static_range(CH):
                xss = xss + (_inputs(a_at + c * GC * 32, g + c * GC < G),)
        accs_g, accs_h = _tile_sums(
            (ws_g,), (ws_h,), (es_g,), (es_h,), xss, k, g, gi, t, CH, F16, LF, T_MAJOR, INT4, 1, PRE
        )
        acc_g = accs_g[0]
        acc_h = accs_h[0]
        row = mt * 16 + g + t * 0  # [1, 8, 1, 4]
        if HAS_BIAS:
            acc_g += gl.load(bias_ptr + expert * stride_be + row).to(gl.float32)
            acc_h += gl.load(bias_ptr + expert * stride_be + row + 8).to(gl.float32)
        wk = gl.load(weight_ptr + token * stride_wt + k).to(gl.float32)
        # the pairs summed in each thread: one layout conversion (one CTA barrier) hands every warp
        # all the pairs' sums of its lane's rows, rather than gl.sum over the warp axis (shuffles and
        # three barriers per half), and fewer registers
        LR: gl.constexpr = gl.BlockedLayout([TOP_K, 1, 1, 1], [1, 8, 1, 4], [1, 1, TOP_K, 1], [3, 1, 2, 0])
        y_g = gl.sum(gl.convert_layout(acc_g * wk, LR), axis=0)  # [8, 1, 4], the same in every warp
        y_h = gl.sum(gl.convert_layout(acc_h * wk, LR), axis=0)
        LS: gl.constexpr = gl.SliceLayout(0, LR)
        rg = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, LS))), 1), 2)
        rt = gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, LS))), 0), 1)
        o = out_ptr + token * stride_om + mt * 16 + rg + rt * 0
        lead = (rt == 0) & (rg >= 0)
        gl.store(o, y_g.to(out_ptr.dtype.element_ty), mask=lead)
        gl.store(o + 8, y_h.to(out_ptr.dtype.element_ty), mask=lead)


def _up_warps(groups: int) -> int:
    """moe_up's warps: 4 where the chunks of 8 groups split evenly over 4 (measured fastest), else 2, 1."""
    chunks = -(-groups // CHUNK)
    return next(w for w in (4, 2, 1) if chunks % w == 0)


def _up_tiles(tokens: int, chunks_per_warp: int, units: int) -> int:
    """moe_up's tiles per program: 2 from two tokens on where a warp's codes of both fit (up to 2
    chunks each) and the units of 8 rows pair up: the inputs packed once per two tiles. One token
    keeps 1: the longer programs delay moe_down."""
    return 2 if tokens >= 2 and chunks_per_warp <= 2 and units % 2 == 0 else 1


def _serves(x: torch.Tensor, index: torch.Tensor, bank: PackedBank) -> bool:
    """What both kernels need of a step: a Hopper GPU, bf16/fp16 activations, few tokens, an
    MXFP4 or int4 bank, top_k a power of two up to 8 (warps and lanes are laid out by it)."""
    if gluon is None or not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if not bank.mxfp4 and not (bank.scales.dtype == torch.float16 and bank.in_features % 64 == 0):
        return False  # int4: fp16 scales, an even group count (a lane's two scales in one load)
    tokens, top_k = index.shape
    return tokens <= CONFIG.max_tokens and top_k in (1, 2, 4, 8) and torch.cuda.get_device_capability(x.device)[0] == 9


def up_applies(x: torch.Tensor, index: torch.Tensor, bank: PackedBank) -> bool:
    """Whether :func:`moe_up` serves this gate_up bank: gate and up rows in tiles of 8 (expert
    width a multiple of 8)."""
    inter = bank.rows // 2
    return _serves(x, index, bank) and bank.rows == 2 * inter and inter % 8 == 0


def down_applies(a: torch.Tensor, index: torch.Tensor, bank: PackedBank) -> bool:
    """Whether :func:`moe_down` serves this down bank: output rows in tiles of 16 (hidden a multiple of 16)."""
    return _serves(a, index, bank) and bank.rows % 16 == 0


def _predecoded(bank: PackedBank, tokens: int) -> int:
    """How many of its chunks moe_down decodes halfway before its wait: at one token every chunk
    of an int4 bank (the words then live across the wait, which from two tokens on costs more than
    it saves); MXFP4 none (its E / O bytes take twice the registers: it is capped instead)."""
    if tokens > 1 or bank.mxfp4:
        return 0
    return -(-bank.in_features // 32 // CHUNK)


def _down_regs(bank: PackedBank, tokens: int) -> dict[str, int]:
    """moe_down's register cap, as a launch option: ``CONFIG.down_regs_mxfp4`` for MXFP4 at one
    token where a warp's code words fit under it (up to ``CONFIG.max_capped_chunks`` chunks of 8
    groups), else none."""
    chunks = -(-bank.in_features // 32 // CHUNK)
    capped = tokens == 1 and bank.mxfp4 and chunks <= CONFIG.max_capped_chunks
    return {"maxnreg": CONFIG.down_regs_mxfp4} if capped else {}


def _scales_evict(tokens: int) -> str:
    """The scales' and zero points' eviction policy: at one token every routed expert's are read by
    one program and once, so first out of L1 and L2; from two tokens on, tokens routed to one
    expert share them."""
    return "evict_first" if tokens == 1 else ""


def _words(codes: torch.Tensor) -> torch.Tensor:
    if codes.stride(-1) != 1 or codes.data_ptr() % 16:
        codes = codes.contiguous()
    return codes.view(torch.int32)


def t_major(a: torch.Tensor) -> torch.Tensor:
    """Activations [P, I] in the order ``moe_up(t_major=True)`` stores them: within each group of
    32, input 4i + t (nibble i of code word t, nibble-major) at 8t + i, so a lane's 8 inputs of a
    group are 16 contiguous bytes (two 8-byte loads for moe_down instead of eight 2-byte ones on
    the few lines of the activations)."""
    pairs, inter = a.shape
    return a.reshape(pairs, inter // 32, 8, 4).transpose(-1, -2).reshape(pairs, inter)


def moe_up(
    x: torch.Tensor,
    index: torch.Tensor,
    bank: PackedBank,
    bias: torch.Tensor | None,
    act: Activation,
    t_major: bool = False,
) -> torch.Tensor:
    """As :func:`.triton_moe.moe_up` (x [T, H], index [T, k] -> activations [T*k, I]); see
    ``up_applies``. t_major: the activations stored as :func:`t_major` orders them, for
    ``moe_down(t_major=True)``."""
    install_ptx_pass()
    tokens, top_k = index.shape
    inter = bank.rows // 2
    words, scales, x = _words(bank.codes), bank.scales.contiguous(), x.contiguous()
    zeros = scales if bank.zeros is None else bank.zeros.contiguous()
    out = torch.empty((tokens * top_k, inter), dtype=x.dtype, device=x.device)
    bias_t = scales if bias is None else bias
    groups = bank.in_features // 32
    warps = _up_warps(groups)
    chw = -(-groups // CHUNK) // warps
    tiles = _up_tiles(tokens, chw, inter // 8)
    rows_first = tokens == 1  # from two tokens on the pairs stay fastest
    pairs, row_tiles = tokens * top_k, inter // 8 // tiles
    _mma_up_kernel[(row_tiles, pairs) if rows_first else (pairs, row_tiles)](
        x, words, scales, zeros, index.reshape(-1), bias_t, out, inter, act.alpha, act.limit,
        x.stride(0), words.stride(0), words.stride(1), scales.stride(0), scales.stride(1), zeros.stride(0),
        zeros.stride(1), 0 if bias is None else bias.stride(0), out.stride(0),
        TOP_K=top_k, G=groups, CHW=chw, WARPS=warps, TILES=tiles, ACT=act.kind, HAS_BIAS=bias is not None,
        F16=x.dtype == torch.float16, PDL=True, T_MAJOR=t_major, INT4=not bank.mxfp4, SYM=bank.zeros is None,
        STAGGER=tokens == 1 and bank.mxfp4, num_warps=warps, launch_pdl=True,  # int4 keeps its loads together
        SCALES_EVICT=_scales_evict(tokens), ROWS_FIRST=rows_first,
    )  # fmt: skip
    return out


def moe_down(
    a: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor,
    bank: PackedBank,
    bias: torch.Tensor | None,
    t_major: bool = False,
) -> torch.Tensor:
    """As :func:`.triton_moe.moe_down` (a [T*k, I] -> [T, H]); see ``down_applies``. t_major: a
    as ``moe_up(t_major=True)`` stores it."""
    install_ptx_pass()
    tokens, top_k = index.shape
    words, scales = _words(bank.codes), bank.scales.contiguous()
    zeros = scales if bank.zeros is None else bank.zeros.contiguous()
    a, weight = a.contiguous(), weight.contiguous()
    out = torch.empty((tokens, bank.rows), dtype=a.dtype, device=a.device)
    bias_t = scales if bias is None else bias
    _mma_down_kernel[(tokens, bank.rows // 16)](
        a, words, scales, zeros, index.reshape(-1), weight, bias_t, out,
        a.stride(0), words.stride(0), words.stride(1), scales.stride(0), scales.stride(1), zeros.stride(0),
        zeros.stride(1), 0 if bias is None else bias.stride(0), weight.stride(0), out.stride(0),
        TOP_K=top_k, G=bank.in_features // 32, HAS_BIAS=bias is not None, F16=a.dtype == torch.float16,
        PDL=True, T_MAJOR=t_major, INT4=not bank.mxfp4, SYM=bank.zeros is None,
        PRE=_predecoded(bank, tokens), SCALES_EVICT=_scales_evict(tokens), num_warps=top_k, launch_pdl=True,
        **_down_regs(bank, tokens),
    )  # fmt: skip
    return out
