"""DeepSeek-V4 checkpoints: DeepSeek's own names read alongside transformers' (:class:`PublishedNames`),
FP8 projections decoded with their block scales (:func:`dense`), FP4 experts kept packed as the
engine's mxfp4 (:func:`fp4_experts`), and the published checkpoint's tensors listed from the config
alone (:func:`published_tensors`), so ``inspect`` sizes the released model from its config.json.

FP4 experts as published: ``{e}.w1.weight`` int8 [I, H/2], two E2M1 codes a byte, the even element
in the low nibble (torch's ``float4_e2m1fn_x2`` order, GPT-OSS's and the engine's mxfp4 order),
``{e}.w1.scale`` F8_E8M0 [I, H/32], one exponent per 32 inputs: exactly OCP MXFP4, so the bytes are
moved into an :class:`~engine.formats.MXFP4Weight` bank, never decoded.
"""

from __future__ import annotations

import torch

from ..checkpoint import TensorInfo, TensorSource
from ..errors import CheckpointError
from ..formats import BLOCK, FormatError, MXFP4Weight
from ..layers import Dense
from ..spec import ModelSpec
from ..weights import LayerWeights
from .deepseek_v4_config import CSA, HASH_MOE, attention_kind, compress_rate, mlp_kind

FP8_BLOCK = 128  # DeepSeek's FP8 projections: one E8M0 (or float32) scale per 128 x 128 block
PUBLISHED_NAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}


class PublishedNames:
    """A checkpoint read under the names transformers saves (``model.layers.N.``...), whether it
    holds those or DeepSeek's own (``layers.N.``, ``embed.weight``, ``norm.weight``, ``hc_head_fn``,
    and ``attn.kv_norm`` where transformers writes ``attn.norm``)."""

    def __init__(self, source: TensorSource):
        self.source = source

    def stored(self, name: str) -> str:
        """The first of the name's spellings the checkpoint holds (the name itself when none)."""
        return next((n for n in spellings(name) if n in self.source), name)

    def __contains__(self, name: str) -> bool:
        return self.stored(name) in self.source

    def read(self, name: str) -> torch.Tensor:
        return self.source.read(self.stored(name))

    # over a tensor index (the planner's view of a checkpoint): the names as stored, each found
    # under either spelling; the planner reads DeepSeek's own names (attn., ffn., embed.weight)
    def names(self) -> list[str]:
        return list(self.source.names())  # type: ignore[attr-defined]

    def info(self, name: str) -> TensorInfo:
        info: TensorInfo = self.source.info(self.stored(name))  # type: ignore[attr-defined]
        return info


def spellings(name: str) -> list[str]:
    """``name`` as transformers saves it, then as DeepSeek publishes it."""
    names = [name, PUBLISHED_NAMES.get(name, name.removeprefix("model."))]
    return names + [n.replace(".attn.norm.", ".attn.kv_norm.") for n in names if ".attn.norm." in n]


def tensor_source(spec: ModelSpec, source: TensorSource) -> TensorSource:
    """How the shard reads this family's checkpoints: both naming schemes (:class:`PublishedNames`)."""
    return PublishedNames(source)


def e8m0_or_float(scale: torch.Tensor) -> torch.Tensor:
    """A scale tensor as float32: E8M0 bytes are 2^(e - 127)."""
    if scale.dtype in (torch.uint8, torch.float8_e8m0fnu):
        return torch.pow(2.0, scale.view(torch.uint8).to(torch.float32) - 127)
    return scale.to(torch.float32)


def fp8_dequantized(weight: torch.Tensor, scale: torch.Tensor, name: str) -> torch.Tensor:
    """An FP8 E4M3 weight [out, in] times its per-128x128-block scale, in float32."""
    out, inner = weight.shape
    grid = (-(-out // FP8_BLOCK), -(-inner // FP8_BLOCK))
    if tuple(scale.shape) != grid:
        raise CheckpointError(
            f"'{name}.scale' has shape {tuple(scale.shape)}; an FP8 weight of shape {(out, inner)} needs "
            f"{grid} (one scale per {FP8_BLOCK}x{FP8_BLOCK} block)"
        )
    full = e8m0_or_float(scale).repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
    return weight.to(torch.float32) * full[:out, :inner]


def dense(w: LayerWeights, name: str) -> Dense:
    """A projection ``{name}.weight``, decoded from FP8 with its block scales where DeepSeek stores it so."""
    weight = w.raw(f"{name}.weight")
    if weight.dtype == torch.float8_e4m3fn and f"{name}.scale" in w:
        weight = fp8_dequantized(weight, w.raw(f"{name}.scale"), w.prefix + name)
    return Dense(weight.to(device=w.device, dtype=w.dtype))


def fp4_experts(w: LayerWeights, num_experts: int) -> tuple[MXFP4Weight, MXFP4Weight]:
    """DeepSeek's FP4 experts (``{e}.w1.weight`` [I, H/2] two E2M1 codes a byte, low nibble first,
    ``{e}.w1.scale`` [I, H/32] E8M0) as mxfp4 banks gate_up [E, 2I, H], down [E, H, I]: the bytes are
    moved, never decoded."""

    def bank(names: tuple[str, ...]) -> MXFP4Weight:
        blocks, scales = [], []
        for e in range(num_experts):
            codes = [w.raw(f"{e}.{n}.weight").view(torch.uint8) for n in names]
            blocks.append(torch.cat(codes).unflatten(-1, (-1, BLOCK // 2)))
            scales.append(torch.cat([e8m0_bytes(w.raw(f"{e}.{n}.scale")) for n in names]))
        try:
            return MXFP4Weight(torch.stack(blocks).to(w.device), torch.stack(scales).to(w.device))
        except FormatError as exc:
            raise CheckpointError(f"'{w.prefix}*.{'/'.join(names)}': {exc}") from exc

    return bank(("w1", "w3")), bank(("w2",))


def e8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent bytes of a scale stored as E8M0 (or its raw bytes)."""
    if scale.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        raise CheckpointError(f"an FP4 expert's scale must be E8M0 (F8_E8M0 or U8), got {scale.dtype}")
    return scale.view(torch.uint8)


# ---- the published checkpoint's tensors, from the config alone ---------------------------------


def published_tensors(spec: ModelSpec) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Name -> (dtype, shape) of every served tensor of DeepSeek's published checkpoint (DeepSeek's
    names; FP4 experts with E8M0 scales per 32, FP8 projections with a scale per 128x128 block,
    bf16 compressor/indexer projections, float32 hyper-connections, sinks and position biases): so
    ``inspect`` and ``render`` size the real model from its config.json alone. MTP layers are not
    served by the pipeline and not listed."""
    out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    h, n, vocab = spec.hidden_size, int(spec.raw["hc_mult"]), spec.vocab_size
    out["embed.weight"], out["head.weight"], out["norm.weight"] = (
        (torch.bfloat16, (vocab, h)), (torch.bfloat16, (vocab, h)), (torch.bfloat16, (h,)),
    )  # fmt: skip
    out.update({"hc_head_fn": (torch.float32, (n, n * h)), "hc_head_base": (torch.float32, (n,)),
                "hc_head_scale": (torch.float32, (1,))})  # fmt: skip
    for i in range(spec.num_layers):
        out.update({f"layers.{i}.{name}": v for name, v in _published_layer(spec, i).items()})
    return out


def _fp8(out: dict[str, tuple[torch.dtype, tuple[int, ...]]], name: str, shape: tuple[int, int]) -> None:
    out[f"{name}.weight"] = (torch.float8_e4m3fn, shape)
    out[f"{name}.scale"] = (torch.float8_e8m0fnu, (-(-shape[0] // FP8_BLOCK), -(-shape[1] // FP8_BLOCK)))


def _fp4(out: dict[str, tuple[torch.dtype, tuple[int, ...]]], name: str, shape: tuple[int, int]) -> None:
    out[f"{name}.weight"] = (torch.int8, (shape[0], shape[1] // 2))
    out[f"{name}.scale"] = (torch.float8_e8m0fnu, (shape[0], shape[1] // BLOCK))


def _published_layer(spec: ModelSpec, i: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    h, d, heads, n = spec.hidden_size, spec.head_dim, spec.num_heads, int(spec.raw["hc_mult"])
    q_rank, groups, o_rank = int(spec.raw["q_lora_rank"]), int(spec.raw["o_groups"]), int(spec.raw["o_lora_rank"])
    experts, inter = int(spec.raw["n_routed_experts"]), int(spec.raw["moe_intermediate_size"])
    bf16, f32 = torch.bfloat16, torch.float32
    out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for name, (rows, cols) in {"attn.wq_a": (q_rank, h), "attn.wq_b": (heads * d, q_rank), "attn.wkv": (d, h),
                               "attn.wo_a": (groups * o_rank, heads * d // groups), "attn.wo_b": (h, groups * o_rank),
                               "ffn.shared_experts.w1": (inter, h), "ffn.shared_experts.w3": (inter, h),
                               "ffn.shared_experts.w2": (h, inter)}.items():  # fmt: skip
        _fp8(out, name, (rows, cols))
    for name, size in {"attn_norm.weight": h, "ffn_norm.weight": h, "attn.q_norm.weight": q_rank,
                       "attn.kv_norm.weight": d}.items():  # fmt: skip
        out[name] = (bf16, (size,))
    out["attn.attn_sink"] = (f32, (heads,))
    for mix in ("hc_attn", "hc_ffn"):
        out.update({f"{mix}_fn": (f32, ((2 + n) * n, n * h)), f"{mix}_base": (f32, ((2 + n) * n,)),
                    f"{mix}_scale": (f32, (3,))})  # fmt: skip
    rate, kind = compress_rate(spec, i), attention_kind(spec, i)
    if rate is not None:
        out.update(_published_compressor("attn.compressor", rate, d, h, 2 if kind == CSA else 1))
    if kind == CSA:
        di, index_heads = int(spec.raw["index_head_dim"]), int(spec.raw["index_n_heads"])
        out.update(_published_compressor("attn.indexer.compressor", rate or 0, di, h, 2))
        _fp8(out, "attn.indexer.wq_b", (index_heads * di, q_rank))
        out["attn.indexer.weights_proj.weight"] = (bf16, (index_heads, h))
    out["ffn.gate.weight"] = (bf16, (experts, h))
    if mlp_kind(spec, i) == HASH_MOE:
        out["ffn.gate.tid2eid"] = (torch.int32, (spec.vocab_size, int(spec.raw["num_experts_per_tok"])))
    else:
        out["ffn.gate.bias"] = (f32, (experts,))
    for e in range(experts):
        for name, shape in (("w1", (inter, h)), ("w3", (inter, h)), ("w2", (h, inter))):
            _fp4(out, f"ffn.experts.{e}.{name}", shape)
    return out


def _published_compressor(prefix: str, rate: int, dim: int, h: int, halves: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:  # fmt: skip
    return {
        f"{prefix}.ape": (torch.float32, (rate, halves * dim)),
        f"{prefix}.wkv.weight": (torch.bfloat16, (halves * dim, h)),
        f"{prefix}.wgate.weight": (torch.bfloat16, (halves * dim, h)),
        f"{prefix}.norm.weight": (torch.bfloat16, (dim,)),
    }
