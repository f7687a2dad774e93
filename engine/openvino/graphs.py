"""OpenVINO graphs a stage compiles: the tiled three-matmul MoE block and a compressed matmul.

The MoE graph is the algebra OpenVINO's ``ConvertTiledMoeBlockTo3GatherMatmuls`` pass recognises
(it then executes only the selected experts; on CPU as ``GatherMatmul``, on Intel GPUs further as
``moe_3gemm_fused_compressed``)::

    x: [R, H] -> Tile [E, 1] -> Reshape [E, R, H]
    Swish(x @ gate[e].T) * (x @ up[e].T) @ down[e].T        # one-input Swish: a beta input breaks fusion
    * ScatterElementsUpdate(zeros [R, E], ids [R, K], weights [R, K]).T -> [E, R, 1]
    ReduceSum over E -> [R, H]

Inputs: ``x`` f32 [R, H], ``ids`` i32 [R, K] (expert ids, shared/dense slices included),
``weights`` f32 [R, K]. R is dynamic: with a static row count the pass still matches but the
plugin computes every expert (FACTS.md), so :func:`moe_graph` never builds one unless asked to
(the refusal test does). Weights enter as constants: plain float, or int4 as OpenVINO's
decompression subgraph (u4 codes [E, O, G, 32] - u4 zero points [E, O, G, 1]) * f16 scales, which
keeps our packed nibbles as they are (both use low nibble first).

Chained layers (:class:`~.runtime.ChainedLayer`) compile a layer's work around its attention as
:func:`entry_graph` (input norm, q/k/v projection, q/k norms: the shard's first layer) and
:func:`layer_graph` (o projection, residual, post norm, softmax top-k routing, the same tiled MoE
block or three matmuls, residual, the next layer's entry).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import torch
from openvino import op
from openvino.utils.node_factory import NodeFactory

from ..formats.base import BLOCK, pack_nibbles
from ..formats.int4 import Int4Weight
from ..formats.int8 import Int8Weight

Weight = torch.Tensor | Int4Weight | Int8Weight  # [E, O, I] (a bank) or [O, I] (one matmul)


@dataclass(frozen=True)
class ExpertBank:
    """E experts of one width as three stacked weights: gate, up [E, I, H]; down [E, H, I]."""

    gate: Weight
    up: Weight
    down: Weight

    @property
    def num_experts(self) -> int:
        return int(_shape(self.gate)[0])

    @property
    def nbytes(self) -> int:
        return sum(weight_bytes(w) for w in (self.gate, self.up, self.down))


def _shape(w: Weight) -> tuple[int, ...]:
    return tuple(w.shape)


def weight_bytes(w: Weight) -> int:
    """Bytes the weight's storage layout holds (its compiled constant is the same size)."""
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return sum(t.numel() * t.element_size() for t in w.tensors().values())


def _u4(values: torch.Tensor) -> op.Constant:
    """uint8 values 0..15 of any shape -> a u4 constant of that shape (flat, low nibble first)."""
    flat = pack_nibbles(values.reshape(-1).contiguous())
    tensor = ov.Tensor(flat.numpy(), list(values.shape), ov.Type.u4)
    return op.Constant(tensor, shared_memory=False)


def swish(x: ov.Node) -> ov.Node:
    """Swish with one input: ``opset.swish`` adds a beta input, which the MoE pass does not match."""
    return NodeFactory("opset4").create("Swish", [x.output(0)])


def _i64(values: list[int]) -> ov.Node:
    return ops.constant(np.array(values, dtype=np.int64))


def weight_constant(w: Weight) -> ov.Node:
    """An f32 [..., O, I] value in the graph: a plain constant, or a compressed one decoded in-graph."""
    if isinstance(w, torch.Tensor):
        return ops.constant(w.detach().to(torch.float32).contiguous().numpy())
    if isinstance(w, Int8Weight):
        codes = ops.convert(ops.constant(w.codes.numpy()), "f16")
        scales = ops.constant(w.scales.to(torch.float16)[..., None].numpy())
        return ops.convert(ops.multiply(codes, scales), "f32")
    shape = _shape(w)
    groups = shape[-1] // BLOCK
    codes = w.codes.reshape(*shape[:-1], groups, BLOCK // 2)
    q = op.Constant(
        ov.Tensor(codes.contiguous().numpy(), [*shape[:-1], groups, BLOCK], ov.Type.u4), shared_memory=False
    )
    z = _u4(w.zero_points()[..., None])
    decoded = ops.multiply(
        ops.subtract(ops.convert(q, "f16"), ops.convert(z, "f16")), ops.constant(w.scales[..., None].numpy())
    )
    flat = ops.reshape(decoded, ops.constant(np.array(shape, dtype=np.int64)), special_zero=False)
    return ops.convert(flat, "f32")


def moe_graph(bank: ExpertBank, top_k: int, name: str, rows: int | None = None) -> ov.Model:
    """The tiled MoE block over ``bank`` for ``top_k`` (id, weight) pairs per row. ``rows`` fixes
    the row count (refused at compile by :func:`~.fusion.check_fused`; only tests build it)."""
    hidden = int(_shape(bank.gate)[-1])
    r = -1 if rows is None else rows
    x = ops.parameter([r, hidden], ov.Type.f32, name="x")
    ids = ops.parameter([r, top_k], ov.Type.i32, name="ids")
    weights = ops.parameter([r, top_k], ov.Type.f32, name="weights")
    return ov.Model([_moe(x, ids, weights, bank)], [x, ids, weights], name)


def _moe(x: ov.Node, ids: ov.Node, weights: ov.Node, bank: ExpertBank) -> ov.Node:
    hidden = int(_shape(bank.gate)[-1])
    experts = bank.num_experts
    tiled = ops.tile(x, ops.constant(np.array([experts, 1], dtype=np.int64)))
    xe = ops.reshape(tiled, ops.constant(np.array([experts, -1, hidden], dtype=np.int64)), special_zero=False)
    gate = ops.matmul(xe, weight_constant(bank.gate), transpose_a=False, transpose_b=True)
    up = ops.matmul(xe, weight_constant(bank.up), transpose_a=False, transpose_b=True)
    act = ops.multiply(swish(gate), up)
    down = ops.matmul(act, weight_constant(bank.down), transpose_a=False, transpose_b=True)
    # [E, 1, R, H] and [E, 1, R, 1]: not no-ops, so they survive until the MoE pass looks for them
    per_expert = ops.reshape(down, _i64([experts, 1, -1, hidden]), special_zero=False)
    rows_of = ops.gather(ops.shape_of(ids), ops.constant(np.array([0], dtype=np.int64)), 0)
    dense_shape = ops.concat([rows_of, ops.constant(np.array([experts], dtype=np.int64))], 0)
    zeros = ops.broadcast(ops.constant(np.float32(0.0)), dense_shape)
    scattered = ops.scatter_elements_update(zeros, ids, weights, ops.constant(np.int64(1)))
    routing = ops.transpose(scattered, ops.constant(np.array([1, 0], dtype=np.int64)))
    routing = ops.reshape(routing, _i64([experts, 1, -1, 1]), special_zero=False)
    summed = ops.reduce_sum(ops.multiply(per_expert, routing), _i64([0]), False)
    return ops.reshape(summed, _i64([-1, hidden]), special_zero=False)


def matmul_graph(w: Weight, name: str, bias: torch.Tensor | None = None) -> ov.Model:
    """y = x @ w.T (+ bias) with rows dynamic; w plain, int8 or int4 (decoded in-graph)."""
    out_features, in_features = _shape(w)
    x = ops.parameter([-1, in_features], ov.Type.f32, name="x")
    y = ops.matmul(x, weight_constant(w), transpose_a=False, transpose_b=True)
    if bias is not None:
        y = ops.add(y, ops.constant(bias.detach().to(torch.float32).numpy()))
    return ov.Model([y], [x], name)


def dense_graph(gate: Weight, up: Weight, down: Weight, name: str) -> ov.Model:
    """A dense SwiGLU block as three compressed matmuls: the peer of all-active slices (Eq. 2)."""
    x = ops.parameter([-1, int(_shape(gate)[-1])], ov.Type.f32, name="x")
    return ov.Model([_dense(x, ExpertBank(gate, up, down))], [x], name)


def _dense(x: ov.Node, whole: ExpertBank) -> ov.Node:
    g = ops.matmul(x, weight_constant(whole.gate), transpose_a=False, transpose_b=True)
    u = ops.matmul(x, weight_constant(whole.up), transpose_a=False, transpose_b=True)
    return ops.matmul(ops.multiply(swish(g), u), weight_constant(whole.down), transpose_a=False, transpose_b=True)


def _rms_norm(x: ov.Node, weight: torch.Tensor, eps: float) -> ov.Node:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis, float32 (as the host's RMSNorm)."""
    mean = ops.reduce_mean(ops.multiply(x, x), _i64([-1]), True)
    inverse = ops.divide(ops.constant(np.float32(1.0)), ops.sqrt(ops.add(mean, ops.constant(np.float32(eps)))))
    return ops.multiply(ops.multiply(x, inverse), ops.constant(weight.detach().to(torch.float32).numpy()))


def _projection(x: ov.Node, w: Weight, bias: torch.Tensor | None) -> ov.Node:
    y = ops.matmul(x, weight_constant(w), transpose_a=False, transpose_b=True)
    return y if bias is None else ops.add(y, ops.constant(bias.detach().to(torch.float32).numpy()))


def entry_graph(entry: Entry, name: str) -> ov.Model:
    """A layer's entry in one call (:class:`Entry`); x the residual rows [R, H]."""
    x = ops.parameter([-1, int(entry.norm_weight.shape[0])], ov.Type.f32, name="x")
    return ov.Model([_entry(x, entry)], [x], name)


def _entry(x: ov.Node, entry: Entry) -> ov.Node:
    y = _projection(_rms_norm(x, entry.norm_weight, entry.eps), entry.weight, entry.bias)
    if entry.heads_norm is None:
        return y
    heads, head_dim = (int(n) for n in entry.heads_norm.shape)
    width = int(_shape(entry.weight)[0])
    qk, v = ops.variadic_split(
        y, ops.constant(np.int64(1)), _i64([heads * head_dim, width - heads * head_dim])
    ).outputs()
    per_head = ops.reshape(qk, _i64([-1, heads, head_dim]), special_zero=False)
    normed = ops.reshape(_rms_norm(per_head, entry.heads_norm, entry.heads_eps), _i64([-1, heads * head_dim]), False)
    return ops.concat([normed, v], 1)


@dataclass(frozen=True)
class Entry:
    """A layer's entry: rms_norm(x) (``norm_weight``, ``eps``) @ ``weight``.T (+ ``bias``), the
    fused q/k/v rows, with ``heads_norm`` [Hq + Hkv, D] the q and k heads each RMS-normed
    (``heads_eps``) and scaled by their row of it (Qwen3's q/k norms)."""

    norm_weight: torch.Tensor
    eps: float
    weight: Weight
    bias: torch.Tensor | None = None
    heads_norm: torch.Tensor | None = None
    heads_eps: float = 0.0


@dataclass(frozen=True)
class Router:
    """Softmax top-k routing in-graph (Qwen3's and Mixtral's ``softmax_top_k``): logits = x @
    ``weight``.T (+ ``bias``); with ``renormalize`` a softmax over the top k logits, else the top
    k of the softmax over all."""

    weight: Weight
    bias: torch.Tensor | None
    top_k: int
    renormalize: bool


def _route(x: ov.Node, router: Router) -> tuple[ov.Output, ov.Node]:
    """-> expert ids i32 [R, k] and their weights f32 [R, k], as the host's softmax_top_k."""
    logits = _projection(x, router.weight, router.bias)
    k = ops.constant(np.int64(router.top_k))
    if router.renormalize:
        top = ops.topk(logits, k, 1, "max", "value", "i32")
        return top.output(1), ops.softmax(top.output(0), 1)
    top = ops.topk(ops.softmax(logits, 1), k, 1, "max", "value", "i32")
    return top.output(1), top.output(0)


@dataclass(frozen=True)
class LayerBlock:
    """A chained layer's call: o projection (``o_weight``, ``o_bias``), post-attention norm, the
    feed-forward block over ``bank`` (routed by ``router``, or dense three matmuls times ``scale``)."""

    o_weight: Weight
    o_bias: torch.Tensor | None
    norm_weight: torch.Tensor
    eps: float
    bank: ExpertBank
    router: Router | None
    scale: float = 1.0


def layer_graph(layer: LayerBlock, name: str, entry: Entry | None) -> ov.Model:
    """A layer after its attention in one call: h = x + heads @ o.T, the post norm, the routing
    and the feed-forward block, x' = h + block, and, with ``entry``, the next layer's entry of x'.
    Inputs: ``heads`` (the attention heads' outputs [R, I]) and ``x`` (the residual [R, H]);
    outputs x' and the entry."""
    out_features, in_features = _shape(layer.o_weight)
    heads = ops.parameter([-1, in_features], ov.Type.f32, name="heads")
    x = ops.parameter([-1, out_features], ov.Type.f32, name="x")
    h = ops.add(x, _projection(heads, layer.o_weight, layer.o_bias))
    normed = _rms_norm(h, layer.norm_weight, layer.eps)
    if layer.router is None:
        y = _dense(normed, layer.bank)
        if layer.scale != 1.0:
            y = ops.multiply(y, ops.constant(np.float32(layer.scale)))
    else:
        ids, weights = _route(normed, layer.router)
        y = _moe(normed, ids, weights, layer.bank)
    following = ops.add(h, y)
    outputs = [following] if entry is None else [following, _entry(following, entry)]
    return ov.Model(outputs, [heads, x], name)
