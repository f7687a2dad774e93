"""Inkling's multi-token-prediction (MTP) layers as a next-token-prediction head.

Depth k (0-based, ``num_mtp_layers`` of them) takes, per row r, a hidden state g_r and the token
k + 1 places after r, and gives a hidden state whose logits predict the token k + 2 places after r:

    x = input_proj([hidden_norm(g); embed_norm(embed(token))])   (hidden first: mtp_hidden_states_first)
    y = block(x)                     a decoder layer: its own attention kind (mtp_local_layer_ids), dense MLP
    y = chain_norm(y)                only with chain_hidden_post_norm
    logits = head(y / multiplier)    the main model's head, muP multiplier and unpadded vocabulary

Depth 0's g is the main model's final hidden state after its final norm (what its head reads,
before the multiplier); depth k + 1's is depth k's y. ``embed`` is the main embedding table
without its norm. This is transformers' ``MtpModel``/``MtpLayer`` composition (5.24,
``modeling_layers.py``) with Inkling's checkpoint names (``model.mtp.layers.K.{hidden_norm,
embed_norm,input_proj}``, the block under ``transformer_block.``, ``model.mtp.chain_norm``).

Per-stream state: each depth's block keeps the cache of a decoder layer of its kind, row r at row
index r (the main model's position of g_r); its queries sit at position r + k + 1, which is what
log scaling reads. Each depth has its own slot table (a chain may run its depths over different
rows, e.g. a depth recomputed after a rejected draft); release and rewind act on every depth.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from ..cache_layout import REWIND_SLACK_POSITIONS, cache_layout
from ..checkpoint import Checkpoint
from ..errors import CheckpointError, ConfigError
from ..frame import Segment
from ..kvcache import LayerKV, SlotTable
from ..layers import Dense, FrameContext, RMSNorm
from ..spec import ModelSpec, load_spec
from ..weights import LayerWeights
from . import inkling
from .common import dense

MTP = "model.mtp."


def mtp_spec(spec: ModelSpec) -> ModelSpec:
    """The spec whose layers are the MTP depths: their attention kinds (``mtp_local_layer_ids``
    sliding, the rest full) and dense MLPs, so the family's builders and cache layouts apply."""
    depths = spec.get("num_mtp_layers")
    if not depths:
        raise ConfigError("this inkling checkpoint has no MTP layers (config.json 'num_mtp_layers' is unset or 0)")
    local = set(spec.get("mtp_local_layer_ids", []))
    raw = {
        **spec.raw,
        "num_hidden_layers": int(depths),
        "layer_types": [inkling.SLIDING if k in local else inkling.FULL for k in range(int(depths))],
        "mlp_layer_types": [inkling.DENSE] * int(depths),
    }
    return dataclasses.replace(spec, num_layers=int(depths), raw=raw)


class MtpDepth(nn.Module):
    """One depth: input_proj over the normed hidden state and token embedding, then its block."""

    def __init__(
        self,
        norms: tuple[RMSNorm, RMSNorm],
        input_proj: Dense,
        block: inkling.InklingDecoderLayer,
        hidden_first: bool,
    ):
        super().__init__()
        self.hidden_norm, self.embed_norm = norms
        self.input_proj, self.block, self.hidden_first = input_proj, block, hidden_first

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, ctx: FrameContext, kv: LayerKV) -> torch.Tensor:
        parts = [self.hidden_norm(hidden), self.embed_norm(embedded)]
        x = self.input_proj(torch.cat(parts if self.hidden_first else parts[::-1], dim=-1))
        y: torch.Tensor = self.block(x, ctx, kv)
        return y


class InklingMtp(nn.Module):
    """The MTP chain with its own per-stream state (see the module docstring)."""

    def __init__(
        self,
        spec: ModelSpec,
        depths: list[MtpDepth],
        embed: torch.Tensor,
        head: Dense,
        chain_norm: RMSNorm | None,
    ):
        super().__init__()
        self.spec = spec
        self.depths = nn.ModuleList(depths)
        self.embed = nn.Parameter(embed, requires_grad=False)
        self.head, self.chain_norm = head, chain_norm
        self.slots: list[SlotTable] = []  # one per depth
        self.kv: list[LayerKV] = []

    @classmethod
    def load(
        cls, model_dir: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> InklingMtp:
        """The MTP layers of an Inkling checkpoint, with the embedding table and head they share."""
        spec = load_spec(model_dir)
        if spec.family != "inkling":
            raise ConfigError(f"MTP layers are read from inkling checkpoints; {model_dir} holds {spec.family}")
        root = LayerWeights(inkling.tensor_source(spec, Checkpoint(model_dir)), "", dtype, torch.device(device))
        depth_spec = mtp_spec(spec)
        hidden_first = bool(spec.get("mtp_hidden_states_first", True))
        depths = [
            _depth(depth_spec, k, root.sub(f"{MTP}layers.{k}."), hidden_first) for k in range(depth_spec.num_layers)
        ]
        chain_norm = None
        if spec.get("chain_hidden_post_norm", False):
            chain_norm = RMSNorm(root.get(f"{MTP}chain_norm.weight"), spec.rms_norm_eps)
        head = inkling.logits_head(spec, root.get("lm_head.weight"))
        return cls(depth_spec, depths, root.get("model.embed_tokens.weight"), head, chain_norm)

    # ---- per-stream state ------------------------------------------------------------------------

    def allocate_cache(self, max_slots: int, max_context: int, rewind_slack: int = REWIND_SLACK_POSITIONS) -> None:
        """Each depth's state for ``max_slots`` streams of ``max_context`` positions."""
        layouts = [cache_layout(self.spec, k) for k in range(self.spec.num_layers)]
        self.kv = [
            layout.state(max_slots, max_context, self.embed.dtype, self.embed.device, rewind_slack)
            for layout in layouts
        ]
        limits = [n for layout in layouts if (n := layout.rewind_limit(max_context, rewind_slack)) is not None]
        limit = min(limits) if limits else None
        self.slots = [SlotTable(max_slots, max_context, limit) for _ in layouts]

    def _slots(self, depth: int) -> SlotTable:
        if not self.slots:
            self.allocate_cache(max_slots=1, max_context=min(self.spec.max_position_embeddings, 4096))
        return self.slots[depth]

    def release(self, slot: int) -> None:
        for depth in range(len(self.depths)):
            self._slots(depth).release(slot)

    def rewind(self, slot: int, position: int) -> None:
        """Every depth back to ``position`` rows (a depth holding fewer stays as it is)."""
        for depth in range(len(self.depths)):
            table = self._slots(depth)
            table.rewind(slot, min(position, table.length(slot)))

    # ---- compute ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, depth: int, slot: int, pos_start: int, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Depth ``depth`` over one stream's rows [pos_start, pos_start + n): hidden [n, H] (g of
        those rows), tokens [n] (the tokens depth + 1 places after each row) -> y [n, H]."""
        rows, table = hidden.shape[0], self._slots(depth)
        table.check_segment(slot, pos_start, rows)
        positions = torch.arange(pos_start, pos_start + rows, device=hidden.device) + depth + 1
        ctx = FrameContext([Segment(slot, 0, rows, pos_start)], positions)
        module = self.depths[depth]
        y: torch.Tensor = module(hidden.to(self.embed.dtype), self.embed[tokens], ctx, self.kv[depth])
        table.claim(slot)
        table.lengths[slot] = pos_start + rows
        return y if self.chain_norm is None else self.chain_norm(y)

    def logits(self, y: torch.Tensor) -> torch.Tensor:
        """[n, H] -> float32 [n, vocab] through the shared head."""
        out: torch.Tensor = self.head(y)
        return out.to(torch.float32)

    def draft(
        self, slot: int, pos_start: int, hidden: torch.Tensor, tokens: list[int]
    ) -> tuple[list[int], torch.Tensor]:
        """Greedy drafts from the whole chain: rows [pos_start, pos_start + n) of the main model's
        final hidden states and the n tokens one place after them (the last one just sampled) ->
        one drafted token per depth and each depth's logits of the last row [depths, vocab]. Depth
        k + 1 reads depth k's outputs and the tokens shifted by one, the draft appended."""
        ids = torch.tensor(tokens, device=self.embed.device)
        drafted: list[int] = []
        last_logits = []
        for depth in range(len(self.depths)):
            hidden = self.step(depth, slot, pos_start, hidden, ids)
            last_logits.append(self.logits(hidden[-1:])[0])
            drafted.append(int(last_logits[-1].argmax()))
            ids = torch.cat([ids[1:], ids.new_tensor([drafted[-1]])])
        return drafted, torch.stack(last_logits)


def _depth(spec: ModelSpec, k: int, w: LayerWeights, hidden_first: bool) -> MtpDepth:
    input_proj = dense(w, "input_proj")
    if tuple(input_proj.weight.shape) != (spec.hidden_size, 2 * spec.hidden_size):
        raise CheckpointError(
            f"'{w.prefix}input_proj.weight' has shape {tuple(input_proj.weight.shape)}, expected "
            f"{(spec.hidden_size, 2 * spec.hidden_size)} (hidden_size from config.json)"
        )
    norms = (
        RMSNorm(w.get("hidden_norm.weight"), spec.rms_norm_eps),
        RMSNorm(w.get("embed_norm.weight"), spec.rms_norm_eps),
    )
    return MtpDepth(norms, input_proj, inkling.build_layer(spec, k, w.sub("transformer_block.")), hidden_first)


__all__ = ["InklingMtp", "MtpDepth", "mtp_spec"]
