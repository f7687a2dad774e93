"""The OpenVINO :class:`~modelfleet.engine.backend.StageBackend`: a torch shard whose heavy
matmuls are compiled OpenVINO blocks (seed 000's resident MoE engine).

What runs where (seed 000 §3):

- OpenVINO (CPU here, an Intel iGPU with ``device GPU``): every sparse feed-forward block as one
  fused MoE call (routed and shared experts), a dense one as all-active slices through the same
  call (Eq. 2) or as three compressed matmuls, as :func:`dense_form` chooses for the device; the
  attention projections and the output head as compressed (int8, or float) matmuls.
- Where the blocks execute in float32 (CPU stages), the layers are plain grouped-query ones and
  routing is softmax top-k (qwen3_moe, mixtral), the layers run chained
  (:class:`.runtime.ChainedLayer`): norms, q/k norms, projections, residual adds, routing and the
  feed-forward block in one call a layer after its attention, that call computing the next
  layer's entry; the host keeps RoPE, the KV cache and attention.
- The host, with the engine's own code: norms, routing (each family's exact rules), RoPE,
  attention over the per-slot KV cache and its :class:`~modelfleet.engine.kvcache.SlotTable`, so
  release, rewind, export and import behave exactly as in the torch backend. Inkling's short
  convolutions and relative-position bias stay there too, with its attention.

The shard is loaded by the torch code path first (formats applied as asked, kernels not
prepared, so int4 codes stay in the storage layout), then each layer is exported and compiled and
the torch weights it replaced are dropped. Fusion is asserted per MoE block (:mod:`.fusion`).
Each block's Eq. 1 exponent is chosen at export by :func:`.ranges.layer_exponent` (0 wherever the
block executes in f32 or bf16, as on CPUs).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path

import torch
from torch import nn

from ..errors import ConfigError
from ..formats.int4 import Int4Weight
from ..formats.int8 import Int8Weight
from ..formats.plan import FormatPlan
from ..layers import Attention, DecoderLayer, Dense, FrameContext, GatedMLP, RMSNorm, SparseMoE, softmax_top_k
from ..models.inkling import ScaledGatedMLP, SinkMoE
from ..paths import user_cache_dir
from ..quantize import QuantizedDense
from ..shard import Shard
from ..spec import ModelSpec, load_spec
from . import export
from .graphs import (
    Entry,
    ExpertBank,
    LayerBlock,
    Router,
    Weight,
    dense_graph,
    entry_graph,
    layer_graph,
    matmul_graph,
    moe_graph,
    weight_bytes,
)
from .ranges import calibration_rows, execution_type, layer_exponent, needs_calibration
from .runtime import (
    ChainedLayer,
    CompiledBlock,
    CompileOptions,
    DenseMatmuls,
    FeedForward,
    FusedMoE,
    OVLinear,
    check_block_fused,
    openvino_device,
)

FAMILIES = ("qwen3_moe", "deepseek_v3", "mixtral", "inkling")  # whose layers this backend exports
# why the others have none
UNEXPORTED = {
    "gpt_oss": (
        "its experts carry gate/up/down biases and a clamped SwiGLU (x * sigmoid(1.702 x), limits of 7), "
        "which the bias-free Swish(gate) * up pattern OpenVINO fuses into GatherMatmul does not express"
    ),
    "deepseek_v4": "its hash-routed and compressed-attention layers have no OpenVINO export here",
}


def family_refusal(family: str) -> str | None:
    if family in FAMILIES:
        return None
    why = UNEXPORTED.get(family, "its attention or expert layout has no OpenVINO export here")
    return (
        f"the OpenVINO backend serves the {', '.join(FAMILIES)} families; this checkpoint is {family!r} "
        f"({why}); run it with --backend torch"
    )


DENSE_FORMS = ("slices", "matmuls")


def dense_form(device: str) -> str:
    """How a dense feed-forward block runs on ``device``: ``slices`` (all-active expert slices
    through the fused MoE call, Eq. 2) or ``matmuls`` (three compressed matmuls). Measured: the
    seed's Arc iGPU runs slices faster (4.5 vs 8.1 ms, its Table 2: the fused GPU primitive); a
    CPU runs matmuls faster (21 vs 30 ms at 1 row, 25 vs 140 ms at 8, docs/results/openvino_stage.md:
    GatherMatmul computes each (row, slice) pair alone where one GEMM shares the rows)."""
    return "matmuls" if device.split(".")[0].upper() == "CPU" else "slices"


CACHE_DIR_ENV = "MF_OPENVINO_CACHE_DIR"


def default_cache_dir() -> Path:
    """Where compiled blocks are cached: $MF_OPENVINO_CACHE_DIR, else ~/.cache/modelfleet/openvino."""
    return user_cache_dir("openvino", CACHE_DIR_ENV)


def host_threads(device: str) -> int | None:
    """torch's intra-op threads in a process serving an OpenVINO stage on ``device``, or None to
    leave them. On a CPU device: 1. OpenVINO's thread pool runs the heavy matmuls on every core;
    a second pool of torch threads, spinning after each host op (norms, routing, attention over a
    few rows), takes cores from it and its spinning slows torch in turn: the demo model decoded
    5-15x slower with both pools at 2 threads on 2 cores than with torch at 1 (or with OpenMP's
    passive wait), docs/results/openvino_stage.md. On a GPU the host's CPU work is all there is."""
    return 1 if device.split(".")[0].upper() == "CPU" else None


def check_device(device: str) -> None:
    """Raise unless OpenVINO sees ``device`` here (a GPU stage on a machine without an Intel GPU)."""
    from .runtime import core

    available = core().available_devices
    kind = device.split(".")[0]
    if device not in available and not (device == kind and any(d.startswith(kind) for d in available)):
        raise ConfigError(
            f"OpenVINO device {device!r} is not available here (OpenVINO sees {', '.join(available) or 'none'}); "
            "run the stage on a node with an Intel GPU, or set its device to cpu"
        )


def expert_width(spec: ModelSpec) -> int:
    return int(spec.require("moe_intermediate_size"))


class OpenVINOShard(Shard):
    """A :class:`Shard` whose feed-forward blocks, attention projections and head run as compiled
    OpenVINO blocks on ``openvino_device``; the rest of the protocol is the torch shard's."""

    openvino_device: str = "CPU"
    dense_form: str = "slices"
    dense_layers: int = 0
    chained_layers: int = 0  # layers run as one call after their attention (runtime.ChainedLayer)
    moe_layers: int = 0
    fused_layers: int = 0
    compile_seconds: float = 0.0
    attenuation_exponents: dict[int, int]
    _ov_bytes: dict[str, dict[str, int]]

    @classmethod
    def load_openvino(
        cls,
        model_dir: str | Path,
        layer_start: int = 0,
        layer_end: int | None = None,
        *,
        device: str = "CPU",
        dtype: str | torch.dtype = torch.float32,
        formats: FormatPlan | None = None,
        precision: str | None = None,
        cache_dir: Path | None = None,
        on_layer: Callable[[int, int], None] | None = None,
        progress: bool = False,
    ) -> OpenVINOShard:
        """Layers [layer_start, layer_end) compiled for ``device`` (cpu/CPU, GPU[.N]); ``dtype`` is
        the host's (norms, attention, KV cache); the compiled blocks take and return float32.
        ``precision`` (runtime.PRECISIONS): by default ``f32`` on CPU (exact, and as fast as
        bf16 there: docs/results/openvino_stage.md) and the device's own (f16) on GPUs."""
        spec = load_spec(model_dir)
        refusal = family_refusal(spec.family)
        if refusal is not None:
            raise ConfigError(refusal)
        ov_device = openvino_device(device)
        threads = host_threads(ov_device)
        if threads is not None and torch.get_num_threads() > threads:
            torch.set_num_threads(threads)  # process-wide: a stage is a process of its own
        shard = cls.load(
            model_dir, layer_start, layer_end, device="cpu", dtype=torch.float32, formats=formats, pack=False
        )
        assert isinstance(shard, OpenVINOShard)
        chosen = precision or ("f32" if ov_device == "CPU" else "default")
        options = CompileOptions(ov_device, chosen, cache_dir)
        check_device(options.device)
        shard.compile(options, on_layer, progress)
        return shard

    def compile(
        self,
        options: CompileOptions,
        on_layer: Callable[[int, int], None] | None = None,
        progress: bool = False,
    ) -> None:
        """Export and compile every layer (and the head), asserting each MoE block fused."""
        started = time.perf_counter()
        self.openvino_device, self._ov_bytes, self.attenuation_exponents = options.device, {}, {}
        self.dense_form, self.dense_layers, self.chained_layers = dense_form(options.device), 0, 0
        layers = list(self.layers)
        chain = chainable(layers, options)
        for done, (offset, layer) in enumerate(_track(list(enumerate(layers)), progress, "compiling"), 1):
            index = self.layer_start + offset
            name = f"layer {index}"
            if chain:
                assert isinstance(layer, DecoderLayer)
                following = layers[offset + 1] if offset + 1 < len(layers) else None
                assert following is None or isinstance(following, DecoderLayer)
                self.layers[offset] = self._chained_layer(layer, following, offset == 0, options, name)
                self.attenuation_exponents[index] = 0
            else:
                layer.mlp = self._compile_mlp(layer.mlp, layer.post_norm.weight, options, name)
                self.attenuation_exponents[index] = layer.mlp.attenuation_exponent
                _replace_linears(layer.attention, options, name, self._count)
            if on_layer is not None:
                on_layer(done, len(layers))
        compiled_head = None if self.head is None else _compiled_linear(self.head, options, "head", self._count)
        if compiled_head is not None:
            self.head = compiled_head  # type: ignore[assignment]
        self.compile_seconds = time.perf_counter() - started

    def run_layers(self, x: torch.Tensor, ctx: FrameContext) -> torch.Tensor:
        """Chained layers hand the next layer its entry (computed in their own call) with x."""
        if not self.chained_layers:
            return super().run_layers(x, ctx)
        entry: torch.Tensor | None = None
        for layer, kv in zip(self.layers, self.kv, strict=True):
            assert isinstance(layer, ChainedLayer)
            x, entry = layer.step(x, entry, ctx, kv)
        return x

    def _count(self, role: str, fmt: str, nbytes: int) -> None:
        by_format = self._ov_bytes.setdefault(role, {})
        by_format[fmt] = by_format.get(fmt, 0) + nbytes

    def _chained_layer(
        self, layer: DecoderLayer, following: DecoderLayer | None, first: bool, options: CompileOptions, name: str
    ) -> ChainedLayer:
        """``layer`` (a plain grouped-query layer: :func:`chainable`) as one compiled call after
        its attention (:class:`.runtime.ChainedLayer`), computing ``following``'s entry."""
        attention, mlp, post = layer.attention, layer.mlp, layer.post_norm
        assert isinstance(attention, Attention) and isinstance(post, RMSNorm)
        qkv, o_proj = _linear_weight(attention.qkv), _linear_weight(attention.o_proj)
        assert qkv is not None and o_proj is not None
        for weight, _, fmt in (qkv, o_proj):
            self._count("attention", fmt, weight_bytes(weight))
        entry = CompiledBlock(entry_graph(_entry(layer), f"{name}.entry"), options) if first else None
        feed = self._export_mlp(mlp, post.weight, options, name)
        assert feed.exponent == 0  # chained only where blocks execute in f32 (chainable)
        router = None
        if feed.top_k is not None:
            assert isinstance(mlp, SparseMoE) and isinstance(mlp.route, partial)
            found = _linear_weight(mlp.router_proj)
            assert found is not None
            router = Router(
                found[0], found[1], int(mlp.route.keywords["top_k"]), bool(mlp.route.keywords["renormalize"])
            )
        spec = LayerBlock(o_proj[0], o_proj[1], post.weight, post.eps, feed.bank, router, feed.scale)
        block = CompiledBlock(
            layer_graph(spec, f"{name}.layer", None if following is None else _entry(following)), options
        )
        if router is not None:
            self._check_fused(block, name)
        attention.register_module("qkv", None)  # their weights live in the compiled blocks now
        attention.register_module("o_proj", None)
        self.chained_layers += 1
        return ChainedLayer(entry, attention, block)

    def _export_mlp(self, mlp: nn.Module, norm_weight: torch.Tensor, options: CompileOptions, name: str) -> FeedForward:
        if isinstance(mlp, SparseMoE):
            banks = [export.routed_bank(mlp.experts, f"{name}.experts")]
            if isinstance(mlp, SinkMoE):  # Inkling: a bank of shared experts, weighted by the router
                assert mlp.shared is not None
                banks.append(export.routed_bank(mlp.shared, f"{name}.shared_experts"))
            elif mlp.shared is not None:
                if not isinstance(mlp.shared, GatedMLP):
                    raise ConfigError(f"{name}: shared experts of type {type(mlp.shared).__name__} are not exported")
                banks.append(export.slices_of(mlp.shared, expert_width(self.spec), f"{name}.shared"))
            bank = export.join(banks) if len(banks) > 1 else banks[0]
            routed = banks[0].num_experts
            shared = bank.num_experts - routed
            top_k = int(self.spec.require("num_experts_per_tok")) + shared
            exponent = _exponent(bank, norm_weight, options)
            self._count("experts", export.bank_format(bank), bank.nbytes)
            return FeedForward(
                export.attenuate(bank, exponent), top_k, exponent, 1.0, mlp.router_proj, mlp.route, routed, shared
            )
        if isinstance(mlp, GatedMLP):  # a dense layer: all-active slices (Eq. 2) or three matmuls
            scale = float(mlp.global_scale) if isinstance(mlp, ScaledGatedMLP) else 1.0
            self.dense_layers += 1
            if self.dense_form == "matmuls":
                whole = export.dense_weights(mlp, f"{name}.mlp")
                exponent = _exponent(whole, norm_weight, options)
                self._count("experts", export.bank_format(whole), whole.nbytes)
                return FeedForward(export.attenuate(whole, exponent), None, exponent, scale)
            bank = export.slices_of(mlp, expert_width(self.spec), f"{name}.mlp")
            exponent = _exponent(bank, norm_weight, options)
            self._count("experts", export.bank_format(bank), bank.nbytes)
            return FeedForward(
                export.attenuate(bank, exponent), bank.num_experts, exponent, scale, shared=bank.num_experts
            )
        raise ConfigError(f"{name}: feed-forward block {type(mlp).__name__} has no OpenVINO export")

    def _compile_mlp(
        self, mlp: nn.Module, norm_weight: torch.Tensor, options: CompileOptions, name: str
    ) -> FusedMoE | DenseMatmuls:
        feed = self._export_mlp(mlp, norm_weight, options, name)
        if feed.top_k is None:
            graph = dense_graph(feed.bank.gate, feed.bank.up, feed.bank.down, name)
            return DenseMatmuls(CompiledBlock(graph, options), feed.exponent, name, feed.scale)
        block = CompiledBlock(moe_graph(feed.bank, feed.top_k, name), options)
        self._check_fused(block, name)
        return FusedMoE(block, feed.router_proj, feed.route, feed.routed, feed.shared, feed.exponent, name, feed.scale)

    def _check_fused(self, block: CompiledBlock, name: str) -> None:
        check_block_fused(block, name)
        self.moe_layers += 1
        self.fused_layers += 1

    @property
    def bytes_by_role(self) -> dict[str, dict[str, int]]:
        """The host's tensors (norms, routers, embeddings, KV-free) plus the compiled blocks' weights."""
        table = {role: dict(by_format) for role, by_format in super().bytes_by_role.items()}
        for role, by_format in getattr(self, "_ov_bytes", {}).items():
            for fmt, nbytes in by_format.items():
                table.setdefault(role, {})[fmt] = table.get(role, {}).get(fmt, 0) + nbytes
        return table

    @property
    def backend_info(self) -> dict[str, object]:
        return {
            "backend": "openvino",
            "device": self.openvino_device,
            "moe_layers": self.moe_layers,
            "fused_layers": self.fused_layers,
            "host_threads": torch.get_num_threads(),
            "dense_form": self.dense_form,
            "dense_layers": self.dense_layers,
            "chained_layers": self.chained_layers,
            "attenuation_exponents": {str(k): v for k, v in self.attenuation_exponents.items() if v},
            "compile_seconds": round(self.compile_seconds, 3),
        }


def _exponent(bank: ExpertBank, norm_weight: torch.Tensor, options: CompileOptions) -> int:
    """Eq. 1's exponent for a block (:func:`.ranges.layer_exponent`): calibrated on rows shaped
    like the block's input (its norm's output) where its execution type's range needs it, else 0."""
    execution = execution_type(options.device, options.precision)
    if not needs_calibration(execution):
        return 0
    return layer_exponent(export.bank_peak(bank, calibration_rows(norm_weight)), execution)


def _linear_weight(module: nn.Module) -> tuple[Weight, torch.Tensor | None, str] | None:
    """The weight of a projection the OpenVINO backend compiles (float, int8, int4), or None."""
    if isinstance(module, QuantizedDense) and isinstance(module.weight, Int8Weight | Int4Weight):
        bias = None if module.bias is None else module.bias.detach()
        return module.weight, bias, module.weight.format
    if type(module) is Dense and not module.keep_plain and module.packed is None:
        bias = None if module.bias is None else module.bias.detach()
        return module.weight.detach().to(torch.float32), bias, "fp32"
    return None


def _compiled_linear(
    module: nn.Module, options: CompileOptions, name: str, count: Callable[[str, str, int], None]
) -> OVLinear | None:
    found = _linear_weight(module)
    if found is None:
        return None
    weight, bias, fmt = found
    role = "head" if name == "head" else "attention"
    count(role, fmt, weight_bytes(weight))
    return OVLinear(CompiledBlock(matmul_graph(weight, f"{name}", bias), options), int(weight.shape[0]))


def _entry(layer: DecoderLayer) -> Entry:
    """A chainable layer's entry: its input norm, its fused q/k/v projection and q/k norms."""
    attention, norm = layer.attention, layer.input_norm
    assert isinstance(attention, Attention) and isinstance(norm, RMSNorm)
    found = _linear_weight(attention.qkv)
    assert found is not None
    return Entry(norm.weight, norm.eps, found[0], found[1], attention.qk_norm_weight, attention.qk_norm_eps)


def chainable(layers: list[nn.Module], options: CompileOptions) -> bool:
    """Whether a shard's layers run chained (:class:`.runtime.ChainedLayer`): blocks executing
    in float32 (the residual stream crosses the graphs; Eq. 1 needs no attenuation or row factors
    there) and every layer a plain pre-norm grouped-query one whose projections compile, its
    feed-forward block softmax-top-k routed (:func:`_routed_in_graph`) or dense three matmuls."""
    if execution_type(options.device, options.precision) != "f32" or not layers:
        return False
    for layer in layers:
        if type(layer) is not DecoderLayer or type(layer.attention) is not Attention:
            return False
        if _linear_weight(layer.attention.qkv) is None or _linear_weight(layer.attention.o_proj) is None:
            return False
        if type(layer.input_norm) is not RMSNorm or type(layer.post_norm) is not RMSNorm:
            return False
        if not _routed_in_graph(layer.mlp) and not (
            type(layer.mlp) is GatedMLP and dense_form(options.device) == "matmuls"
        ):
            return False
    return True


def _routed_in_graph(mlp: nn.Module) -> bool:
    """A sparse block whose routing the layer's graph computes: softmax top-k over a compiled
    router projection, no shared experts (Qwen3, Mixtral)."""
    if type(mlp) is not SparseMoE or mlp.shared is not None or _linear_weight(mlp.router_proj) is None:
        return False
    route = mlp.route
    return (
        isinstance(route, partial) and route.func is softmax_top_k and set(route.keywords) == {"top_k", "renormalize"}
    )


def _replace_linears(
    root: nn.Module, options: CompileOptions, name: str, count: Callable[[str, str, int], None]
) -> None:
    """Every compilable projection under ``root`` (attention: q, k, v, o and MLA's) as an OVLinear;
    projections a layer reads directly (``keep_plain``) stay on the host."""
    for child_name, child in list(root.named_children()):
        compiled = _compiled_linear(child, options, f"{name}.{child_name}", count)
        if compiled is not None:
            setattr(root, child_name, compiled)
        else:
            _replace_linears(child, options, f"{name}.{child_name}", count)


def _track(items: list, show: bool, label: str) -> Iterable:  # type: ignore[type-arg]
    if not show:
        return items
    from rich.console import Console
    from rich.progress import track

    return track(items, description=label, console=Console(stderr=True))
