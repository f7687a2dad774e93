"""Compiled OpenVINO blocks as torch modules a shard's layers call like the ones they replace.

Each block keeps one compiled model and one reusable infer request (seed 000 §3.2); inputs are
float32 rows [R, H] (R dynamic), outputs come back as float32 torch tensors. Routing stays on the
host (the family's own router, exactly as the torch backend runs it) and enters the MoE graph as
expert ids and weights, shared experts and dense slices as extra always-selected ids.

Compile settings: ``f32`` (INFERENCE_PRECISION_HINT=f32, DYNAMIC_QUANTIZATION_GROUP_SIZE=0) is
exact to float32 rounding, what golden tests and CPU stages use; ``default`` leaves OpenVINO's
per-device defaults (bf16 and dynamic int8 activations on CPU, f16 on GPU, ~1e-2 relative).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openvino as ov
import torch
from torch import nn

from ..kvcache import LayerKV
from ..layers import Attention, FrameContext
from .fusion import check_fused, fused_count, layer_types
from .graphs import ExpertBank
from .ranges import restore, row_factors

PRECISIONS = {
    "f32": {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"},
    "default": {},
}

_core: ov.Core | None = None
_core_lock = threading.Lock()


def core() -> ov.Core:
    """One OpenVINO core per process (it owns the device plugins and their thread pools)."""
    global _core
    with _core_lock:
        if _core is None:
            _core = ov.Core()
        return _core


def openvino_device(device: str) -> str:
    """A plan's device for an OpenVINO stage -> OpenVINO's name: cpu/CPU -> CPU; GPU[.N], NPU as they are."""
    return "CPU" if device.lower() == "cpu" else device


@dataclass(frozen=True)
class CompileOptions:
    device: str = "CPU"  # OpenVINO's device name
    precision: str = "f32"
    cache_dir: Path | None = None  # compiled blobs, so a restarted stage does not recompile from scratch

    def config(self) -> dict[str, str]:
        config = dict(PRECISIONS[self.precision])
        if self.cache_dir is not None:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            config["CACHE_DIR"] = str(self.cache_dir)
        return config


class CompiledBlock:
    """A compiled model and its one reusable infer request."""

    def __init__(self, model: ov.Model, options: CompileOptions):
        self.compiled = core().compile_model(model, options.device, options.config())
        self.request = self.compiled.create_infer_request()
        self.device = options.device

    def __call__(self, *inputs: np.ndarray) -> torch.Tensor:
        # each input bound as a tensor over the array's own memory, then infer() without inputs:
        # passing them to infer() costs ~30 us a call in its Python input dispatch (more than a
        # small block's whole compute; docs/results/openvino_stage.md, the per-call profile)
        for i, x in enumerate(inputs):
            self.request.set_input_tensor(i, ov.Tensor(np.ascontiguousarray(x), shared_memory=True))
        self.request.infer()
        return torch.from_numpy(self.request.get_output_tensor(0).data.copy())

    def outputs(self, *inputs: np.ndarray) -> list[torch.Tensor]:
        """Every output of the block (one call), as float32 torch tensors."""
        first = self(*inputs)
        rest = range(1, len(self.compiled.outputs))
        return [first, *(torch.from_numpy(self.request.get_output_tensor(i).data.copy()) for i in rest)]

    @property
    def fused_matmuls(self) -> int:
        return fused_count(layer_types(self.compiled), self.device)


def _rows(x: torch.Tensor) -> np.ndarray:
    return x.detach().to(torch.float32).contiguous().numpy()


class OVLinear(nn.Module):
    """y = x @ W.T (+ bias) as a compiled (int8/int4 compressed or float) matmul."""

    def __init__(self, block: CompiledBlock, out_features: int):
        super().__init__()
        self.block, self.out_features = block, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = self.block(_rows(x.reshape(-1, x.shape[-1])))
        return y.reshape(*lead, self.out_features).to(x.dtype)


class FusedMoE(nn.Module):
    """A feed-forward block as one fused MoE call.

    Routed (``route`` given): the family's router picks ids and weights on the host; ``shared``
    slices (ids num_routed .. num_routed + shared - 1) join every row, with weight 1, or with the
    per-row weights a router returns as its third value (Inkling's sink routing weighs its shared
    experts per token). Dense (``route`` None): every one of ``shared`` slices is active with
    weight ``slice_weight`` (1, or a dense block's learned scale: Eq. 2). Weights are divided by the
    row factor F and the output multiplied by A * F in float32 (Eq. 1).
    """

    def __init__(
        self,
        block: CompiledBlock,
        router_proj: nn.Module | None,
        route: Callable[[torch.Tensor], tuple[torch.Tensor, ...]] | None,
        num_routed: int,
        shared: int,
        attenuation_exponent: int,
        layer: str,
        slice_weight: float = 1.0,
    ):
        super().__init__()
        self.block, self.router_proj = block, router_proj
        self.route = route  # the family's router: functools.partial (Qwen3) or a module (DeepSeek)
        self.num_routed, self.shared = num_routed, shared
        self.attenuation_exponent = attenuation_exponent
        self.layer, self.slice_weight = layer, slice_weight
        self.shared_ids = torch.arange(num_routed, num_routed + shared, dtype=torch.int32)  # not a weight

    def selections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids int32 [R, K] and weights float32 [R, K] for the rows of x (routed, then shared)."""
        rows = x.shape[0]
        ids = self.shared_ids.expand(rows, self.shared)
        weights = torch.full((rows, self.shared), self.slice_weight, dtype=torch.float32)
        if self.route is None:
            return ids, weights
        assert self.router_proj is not None
        index, weight, *shared_weights = self.route(self.router_proj(x))
        if not self.shared:  # routed experts only (Qwen3, Mixtral): no concatenation
            return index.to(torch.int32), weight.to(torch.float32)
        if shared_weights:
            weights = shared_weights[0].to(torch.float32)
        return (
            torch.cat([index.to(torch.int32), ids], dim=1),
            torch.cat([weight.to(torch.float32), weights], dim=1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.selections(x)
        factors = row_factors(weights)
        y = self.block(_rows(x), ids.contiguous().numpy(), (weights / factors).contiguous().numpy())
        return restore(y, factors, self.attenuation_exponent).to(x.dtype)


class DenseMatmuls(nn.Module):
    """A dense SwiGLU block as three compressed matmuls (one compiled block), its output times
    ``scale`` (1, or the block's learned scale) and A = 2^``attenuation_exponent`` in float32."""

    def __init__(self, block: CompiledBlock, attenuation_exponent: int, layer: str, scale: float = 1.0):
        super().__init__()
        self.block, self.attenuation_exponent, self.layer, self.scale = block, attenuation_exponent, layer, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(_rows(x))
        return (y * (self.scale * float(2**self.attenuation_exponent))).to(x.dtype)


def check_block_fused(block: CompiledBlock, layer: str) -> None:
    check_fused(block.compiled, block.device, layer)


@dataclass(frozen=True)
class FeedForward:
    """A layer's feed-forward block exported for OpenVINO, not yet compiled: ``bank`` attenuated
    by 2^``exponent`` (Eq. 1); ``top_k`` (id, weight) pairs a row, or None for a dense block's
    whole weights (three matmuls, output times ``scale``); the host's selection (the family's router,
    ``routed`` experts then ``shared`` always-active ones, weighted ``scale`` unless routed)."""

    bank: ExpertBank
    top_k: int | None
    exponent: int
    scale: float
    router_proj: nn.Module | None = None
    route: Callable[[torch.Tensor], tuple[torch.Tensor, ...]] | None = None
    routed: int = 0
    shared: int = 0


class ChainedLayer(nn.Module):
    """A pre-norm grouped-query layer (:class:`~modelfleet.engine.layers.DecoderLayer` over an
    :class:`~modelfleet.engine.layers.Attention`) as one compiled call after the host's attention,
    that call computing the next layer's entry:

    - ``entry`` (the shard's first layer only): input norm, the fused q/k/v projection and the
      q/k norms;
    - the host: RoPE, the KV cache and attention (the engine's own code);
    - ``block``: the output projection, the residual add, the post-attention norm, the routing
      (softmax top-k, in-graph), the feed-forward block (fused MoE or three matmuls), the residual
      add and the next layer's entry.

    One call a layer instead of three, and the norms, adds and routing off the host: on the demo
    model a step is per-call overhead (docs/results/openvino_stage.md). Only where blocks execute
    in float32 and routing is softmax top-k (:func:`~.stage.chainable`)."""

    def __init__(self, entry: CompiledBlock | None, attention: Attention, block: CompiledBlock):
        super().__init__()
        self.entry, self.attention, self.block = entry, attention, block

    def step(
        self, x: torch.Tensor, entry: torch.Tensor | None, ctx: FrameContext, kv: LayerKV
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x and this layer's entry (None: computed here) -> the next x and the next layer's entry
        (None after a shard's last layer)."""
        rows = _rows(x)
        if entry is None:
            if self.entry is None:
                raise RuntimeError("a chained layer after a shard's first takes its entry from the layer before")
            entry = self.entry(rows)
        heads = self.attention.attend_projected(entry.to(x.dtype), ctx, kv, x.dtype, qk_normed=True)
        out = self.block.outputs(_rows(heads), rows)
        return out[0].to(x.dtype), out[1] if len(out) > 1 else None

    def forward(self, x: torch.Tensor, ctx: FrameContext, kv: LayerKV) -> torch.Tensor:
        return self.step(x, None, ctx, kv)[0]
