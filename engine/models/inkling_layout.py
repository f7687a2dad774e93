"""Inkling checkpoints as the engine reads them: every layout under transformers' text-model names.

Three layouts exist:
- ``inkling_text`` as transformers saves it: ``model.layers.N.self_attn.q_proj.weight``, ... (as read);
- a multimodal checkpoint in transformers' in-memory names: the same under ``model.language_model.``;
- the released (original) layout, which transformers also writes for a multimodal model:
  ``model.llm.embed``, ``model.llm.layers.N.attn.wq_du``, fused ``w13`` matrices whose rows
  alternate gate and up (``mlp.w13_dn`` [2I, H], ``experts.w13_weight`` [E, 2I, H],
  ``shared_experts.shared_w13_weight`` [S, 2I, H]), ``mlp.gate.bias`` for the correction bias,
  ``model.llm.unembed`` for the head (transformers' ``conversion_mapping`` for ``inkling_mm_model``).

:class:`RenamedTensors` presents any of them under the first layout's names, converting on read
(de-interleaving gate/up rows), and lists only the text decoder's tensors: the vision and audio
towers are neither read nor counted. Tensors it does not name (MTP layers) stay reachable by their
own names; the MTP layers' (``model.mtp.layers.K.{embed_norm,hidden_norm,input_proj}``,
``model.mtp.chain_norm``) are named alike in every layout, their blocks converted like any layer's.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from ..checkpoint import TensorInfo

ORIGINAL, LANGUAGE_MODEL = "model.llm.", "model.language_model."
# (transformers' name within a layer, the original's), most specific first; applied as prefixes
LAYER_RENAMES = (
    ("self_attn.q_proj.", "attn.wq_du."),
    ("self_attn.k_proj.", "attn.wk_dv."),
    ("self_attn.v_proj.", "attn.wv_dv."),
    ("self_attn.r_proj.", "attn.wr_du."),
    ("self_attn.o_proj.", "attn.wo_ud."),
    ("self_attn.k_sconv.conv1d.", "attn.k_sconv."),
    ("self_attn.v_sconv.conv1d.", "attn.v_sconv."),
    ("self_attn.", "attn."),
    ("attn_sconv.conv1d.", "attn_sconv."),
    ("mlp_sconv.conv1d.", "mlp_sconv."),
    ("input_layernorm.", "attn_norm."),
    ("post_attention_layernorm.", "mlp_norm."),
    ("mlp.down_proj.weight", "mlp.w2_md.weight"),
    ("mlp.experts.down_proj", "mlp.experts.w2_weight"),
    ("mlp.shared_experts.down_proj", "mlp.shared_experts.shared_w2_weight"),
    ("mlp.gate.e_score_correction_bias", "mlp.gate.bias"),
)
# transformers' name within a layer -> (the original fused tensor, the dim whose rows alternate, which half)
HALVES = {
    "mlp.gate_proj.weight": ("mlp.w13_dn.weight", 0, 0),
    "mlp.up_proj.weight": ("mlp.w13_dn.weight", 0, 1),
    "mlp.shared_experts.gate_proj": ("mlp.shared_experts.shared_w13_weight", 1, 0),
    "mlp.shared_experts.up_proj": ("mlp.shared_experts.shared_w13_weight", 1, 1),
}
DEINTERLEAVED = {"mlp.experts.gate_up_proj": ("mlp.experts.w13_weight", 1)}
OUTER = {
    "model.embed_tokens.weight": "embed.weight",
    "model.embed_tokens.embed_norm.weight": "embed_norm.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "unembed.weight",
}
LAYERS = "model.layers."
MTP_BLOCK = re.compile(r"^model\.mtp\.layers\.\d+\.transformer_block\.")

Conversion = tuple[str, int, int | None]  # (source name, dim, half): dim -1 = as stored; half None = whole


def _rename(rest: str, forward: bool) -> str | None:
    for hf, original in LAYER_RENAMES:
        src, dst = (hf, original) if forward else (original, hf)
        if rest.startswith(src):
            return dst + rest[len(src) :]
    return None


def _layer_source(layer: str, rest: str) -> Conversion:
    """A tensor inside a decoder layer (``rest``, by transformers' name) in the original layer ``layer``."""
    if rest in HALVES:
        fused, dim, half = HALVES[rest]
        return layer + fused, dim, half
    if rest in DEINTERLEAVED:
        fused, dim = DEINTERLEAVED[rest]
        return layer + fused, dim, None
    renamed = _rename(rest, forward=True)
    return layer + (renamed if renamed is not None else rest), -1, None


def original_source(name: str) -> Conversion | None:
    """Where transformers' ``name`` comes from in the original layout (an MTP layer's block,
    ``model.mtp.layers.K.transformer_block.``, holds a decoder layer's tensors by the same names)."""
    if name in OUTER:
        return ORIGINAL + OUTER[name], -1, None
    block = MTP_BLOCK.match(name)
    if block is not None:
        return _layer_source(block.group(0), name[block.end() :])
    if not name.startswith(LAYERS):
        return None
    index, _, rest = name[len(LAYERS) :].partition(".")
    return _layer_source(f"{ORIGINAL}layers.{index}.", rest)


def transformers_names(original: str) -> list[str]:
    """transformers' names of the tensors an original-layout tensor holds ([] for the towers)."""
    if not original.startswith(ORIGINAL):
        return []
    rest = original[len(ORIGINAL) :]
    outer = [hf for hf, name in OUTER.items() if name == rest]
    if outer or not rest.startswith("layers."):
        return outer
    index, _, inner = rest[len("layers.") :].partition(".")
    layer = f"{LAYERS}{index}."
    halves = [layer + hf for hf, (fused, _, _) in HALVES.items() if fused == inner]
    fused = [layer + hf for hf, (name, _) in DEINTERLEAVED.items() if name == inner]
    if halves or fused:
        return halves or fused
    renamed = _rename(inner, forward=False)
    return [layer + (renamed if renamed is not None else inner)]


def convert(tensor: torch.Tensor, dim: int, half: int | None) -> torch.Tensor:
    """Rows of ``dim`` alternating gate, up -> [gate; up] (half None) or one half of them."""
    if dim < 0:
        return tensor
    halves: tuple[torch.Tensor, ...] = tensor.unflatten(dim, (-1, 2)).unbind(dim + 1)
    if half is None:
        return torch.cat(halves, dim=dim).contiguous()
    return halves[half].contiguous()


class RenamedTensors:
    """A checkpoint in the original (or multimodal) layout under transformers' text-model names."""

    def __init__(self, source: Any, prefix: str):
        self.source, self.prefix = source, prefix

    def _where(self, name: str) -> Conversion | None:
        if self.prefix == ORIGINAL:
            found = original_source(name)
            return found if found is not None and found[0] in self.source else None
        if name.startswith("model."):
            moved = self.prefix + name[len("model.") :]
            return (moved, -1, None) if moved in self.source else None
        return (name, -1, None) if name in self.source else None

    def __contains__(self, name: str) -> bool:
        return self._where(name) is not None or name in self.source

    def read(self, name: str) -> torch.Tensor:
        where = self._where(name)
        if where is None:
            result: torch.Tensor = self.source.read(name)
            return result
        source, dim, half = where
        return convert(self.source.read(source), dim, half)

    def names(self) -> list[str]:
        """The text decoder's tensors, by transformers' names."""
        out: list[str] = []
        for name in self.source.names():
            if self.prefix == ORIGINAL:
                out += transformers_names(name)
            elif name.startswith(self.prefix):
                out.append("model." + name[len(self.prefix) :])
            elif name == "lm_head.weight":
                out.append(name)
        return out

    def info(self, name: str) -> TensorInfo:
        where = self._where(name)
        if where is None:
            result: TensorInfo = self.source.info(name)
            return result
        source, dim, half = where
        info: TensorInfo = self.source.info(source)
        if half is None:
            return info
        shape = tuple(size // 2 if d == dim else size for d, size in enumerate(info.shape))
        return dataclasses.replace(info, shape=shape, nbytes=info.nbytes // 2)


def layout_prefix(source: Any) -> str | None:
    """The prefix of the text decoder's tensors when not transformers' text layout, else None."""
    for prefix, probes in (
        (ORIGINAL, ("embed.weight", "norm.weight", "layers.0.attn_norm.weight")),
        (LANGUAGE_MODEL, ("embed_tokens.weight", "norm.weight", "layers.0.input_layernorm.weight")),
    ):
        if any(prefix + probe in source for probe in probes):
            return prefix
    return None


def tensor_source(source: Any) -> Any:
    """``source`` itself in transformers' text layout, else a :class:`RenamedTensors` view of it."""
    prefix = layout_prefix(source)
    return source if prefix is None else RenamedTensors(source, prefix)
