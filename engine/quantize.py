"""Weight formats applied to built model code: a transformation pass, not branches in layers.

Family builders produce plain :class:`~engine.layers.Dense` projections and
:class:`~engine.layers.Experts` banks. :func:`apply_formats` walks a built module and replaces
each one whose role (see :mod:`engine.formats.plan`) has a format with a
:class:`QuantizedDense` or :class:`QuantizedExperts` holding a
:class:`~engine.formats.QuantizedWeight`; layers call them exactly as they called the plain
modules. :func:`target_format` is the one decision of what gets which format, shared by
quantize-at-load and by loading a quantized checkpoint, so both build the same modules.

Invariants: a Dense marked ``keep_plain`` (its weight is read directly, e.g. DeepSeek's
``kv_b_proj``) and everything outside the four roles stay plain; a plain format equal to the
weight's dtype leaves the module as it is (so CPU oneDNN packing still applies); quantized
modules are never packed for oneDNN (they are not Dense or Experts instances).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from .formats import FormatError, Int8Weight, QuantizedWeight, quantize
from .formats.plain import PLAIN_DTYPES, PlainWeight
from .formats.plan import FormatPlan, role_of
from .kernels import grouped_moe
from .layers import (
    ClampedSwiGLU,
    Dense,
    Experts,
    forward_grouped,
    gathered_wins,
    glu_kind,
    silu_glu,
    use_gathered,
    weighted_sum_of_pairs,
)

if TYPE_CHECKING:
    from .formats.banks import PackedBank

DTYPE_FORMATS = {dtype: name for name, dtype in PLAIN_DTYPES.items()}


class QuantizedDense(nn.Module):
    """y = W x + bias with W in a weight format; weight: (out, in)."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = weight
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.weight.matmul(x)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def quantized_weights(self) -> dict[str, QuantizedWeight]:
        return {"weight": self.weight}


class QuantizedExperts(nn.Module):
    """A bank of E experts in a weight format: gate_up (E, 2I, H) as [gate; up] rows, down (E, H, I).

    On CUDA, a few (token, expert) pairs (decode) read each pair's packed expert in place with no
    host synchronisation, so decode steps can be graph-captured: int4/int4_sym/mxfp4 banks with
    bf16 or fp16 activations and a SiLU or GPT-OSS GLU run as two fused kernels (gate_up with bias
    and activation; down with bias and the weighted sum over each token's experts, see
    :mod:`~.formats.triton_moe`); other cases run the format's gathered matmuls with the
    activation and sum between them. Otherwise, and for formats without those kernels, each used
    expert runs once over its tokens (grouped), which synchronises with the host.
    """

    def __init__(
        self,
        gate_up: QuantizedWeight,
        down: QuantizedWeight,
        gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
        activation: Callable[[torch.Tensor], torch.Tensor] = silu_glu,
    ):
        super().__init__()
        if gate_up.num_experts is None or gate_up.num_experts != down.num_experts:
            raise FormatError(f"expert banks disagree: gate_up {gate_up.shape}, down {down.shape}")
        self.gate_up, self.down = gate_up, down
        self.gate_up_bias = None if gate_up_bias is None else nn.Parameter(gate_up_bias, requires_grad=False)
        self.down_bias = None if down_bias is None else nn.Parameter(down_bias, requires_grad=False)
        self.activation = activation

    @property
    def num_experts(self) -> int:
        assert self.gate_up.num_experts is not None
        return self.gate_up.num_experts

    @property
    def format(self) -> str:
        return self.gate_up.format

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up.expert_matmul(e, x)
        if self.gate_up_bias is not None:
            h = h + self.gate_up_bias[e].to(h.dtype)
        y = self.down.expert_matmul(e, self.activation(h))
        return y if self.down_bias is None else y + self.down_bias[e].to(y.dtype)

    def gathered_on(self, device: torch.device) -> bool:
        """Whether decode pairs on ``device`` run through a gathered kernel (graph-capturable)."""
        return self.gate_up.has_gathered_kernel(device) and self.down.has_gathered_kernel(device)

    def fused_kernels(self, x: torch.Tensor) -> tuple[PackedBank, PackedBank, tuple[int, float, float]] | None:
        """The two banks as the fused kernels read them and the activation's (kind, alpha, limit),
        when those kernels apply to activations like ``x``."""
        if x.dtype not in (torch.bfloat16, torch.float16) or not x.is_cuda:
            return None
        if self.activation is silu_glu:
            act = (1, 1.0, 0.0)  # triton_moe.ACT_SILU
        elif isinstance(self.activation, ClampedSwiGLU):
            act = (2, self.activation.alpha, self.activation.limit)  # ACT_CLAMPED_SWIGLU
        else:
            return None
        self.gate_up.prepare_for(x)
        self.down.prepare_for(x)
        gate_up, down = self.gate_up.fused_bank(), self.down.fused_bank()
        return None if gate_up is None or down is None else (gate_up, down, act)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x: [T, H]; index, weight: [T, k] -> sum_k weight * expert_index(x): [T, H]."""
        act = glu_kind(self.activation)
        if act is not None and grouped_moe.available(x) and not gathered_wins(index.numel(), self.format):
            banks = self.grouped_banks(x)
            if banks is not None:
                gate_up_bias, down_bias = self.gate_up_bias, self.down_bias
                return grouped_moe.grouped_experts(x, index, weight, *banks, gate_up_bias, down_bias, act)
        if not (use_gathered(x, index, self.format) and self.gathered_on(x.device)):
            return forward_grouped(self.expert, self.num_experts, x, index, weight)
        fused = self.fused_kernels(x)
        if fused is not None:
            from .formats import triton_moe
            from .formats.banks import Activation

            gate_up, down, act = fused
            activation = Activation(*act)
            return triton_moe.moe_pair(x, index, weight, gate_up, down, self.gate_up_bias, self.down_bias, activation)
        flat = index.reshape(-1)
        h = self.gate_up.gathered_matmul(x, flat, index.shape[1])  # [T*k, 2I]
        if self.gate_up_bias is not None:
            h = h + self.gate_up_bias[flat].to(h.dtype)
        y = self.down.gathered_matmul(self.activation(h), flat, 1)  # [T*k, H]
        if self.down_bias is not None:
            y = y + self.down_bias[flat].to(y.dtype)
        return weighted_sum_of_pairs(y, weight)

    def grouped_banks(self, x: torch.Tensor) -> tuple[grouped_moe.GroupedBank, grouped_moe.GroupedBank] | None:
        """Both banks as :mod:`~.kernels.grouped_moe` reads them, for activations like x (CUDA),
        or None where a bank's format has no grouped kernel."""
        self.gate_up.prepare_for(x)
        self.down.prepare_for(x)
        gate_up, down = grouped_bank(self.gate_up, x), grouped_bank(self.down, x)
        return None if gate_up is None or down is None else (gate_up, down)

    def quantized_weights(self) -> dict[str, QuantizedWeight]:
        return {"gate_up": self.gate_up, "down": self.down}


def grouped_bank(weight: QuantizedWeight, x: torch.Tensor) -> grouped_moe.GroupedBank | None:
    """A prepared CUDA expert bank in the grouped kernel's terms (int4, int4_sym, mxfp4 in their
    nibble-major order; int8; a plain bank in x's dtype), or None."""
    if weight.device != x.device or weight.num_experts is None:
        return None
    if isinstance(weight, Int8Weight):
        return grouped_moe.GroupedBank(grouped_moe.FMT_INT8, weight.codes, weight.scales)
    if isinstance(weight, PlainWeight):
        plain = weight.weight.dtype == x.dtype and weight.weight.stride(-1) == 1
        return grouped_moe.GroupedBank(grouped_moe.FMT_PLAIN, weight.weight) if plain else None
    packed = weight.fused_bank()
    if packed is None or packed.codes.stride(-1) != 1:
        return None
    fmt = grouped_moe.FMT_MXFP4 if packed.mxfp4 else grouped_moe.FMT_INT4
    return grouped_moe.GroupedBank(fmt, packed.codes, packed.scales, packed.zeros)


class QuantizedEmbedding(nn.Module):
    """The token embedding table, weight (vocab, hidden), in a weight format: a lookup decodes
    only the rows of the ids asked for. It keeps its storage layout resident (row lookups read
    it) even when a tied head's matmul builds a kernel layout of the same weight."""

    def __init__(self, weight: QuantizedWeight):
        super().__init__()
        if len(weight.shape) != 2:
            raise FormatError(f"an embedding table is 2-D (vocab, hidden), got {weight.format} {weight.shape}")
        weight.keep_storage_layout()
        self.weight = weight

    def forward(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """ids: int [R] -> [R, hidden] in ``dtype``."""
        return self.weight.rows(ids, dtype)

    def quantized_weights(self) -> dict[str, QuantizedWeight]:
        return {"weight": self.weight}


def is_quantized(module: nn.Module) -> bool:
    return isinstance(module, QuantizedDense | QuantizedExperts)


def target_format(path: str, module: nn.Module, plan: FormatPlan, keep_same_dtype: bool = True) -> str | None:
    """The format the module at ``path`` must be held in, or None to leave it as it is."""
    if isinstance(module, Dense) and module.keep_plain:
        return None
    if not isinstance(module, Dense | Experts | QuantizedExperts):
        return None
    name = plan.format_for(role_of(path))
    if name is None:
        return None
    if isinstance(module, QuantizedExperts):
        return None if module.format == name else name
    current = module.weight if isinstance(module, Dense) else module.gate_up
    if keep_same_dtype and current.dtype == PLAIN_DTYPES.get(name):
        return None  # already in that dtype: keep the plain module (and its CPU packing)
    return name


def _quantize(tensor: torch.Tensor | QuantizedWeight, name: str, path: str) -> QuantizedWeight:
    try:
        source = tensor.dequantize() if isinstance(tensor, QuantizedWeight) else tensor
        return quantize(source, name)
    except FormatError as exc:
        raise FormatError(f"cannot hold {path} ({role_of(path)}) in {name}: {exc}") from exc


def quantized_module(path: str, module: nn.Module, name: str) -> nn.Module:
    """``module`` (Dense, Experts or QuantizedExperts) with its weights in format ``name``."""
    if isinstance(module, Dense):
        bias = None if module.bias is None else module.bias.data
        return QuantizedDense(_quantize(module.weight.data, name, f"{path}.weight"), bias)
    assert isinstance(module, Experts | QuantizedExperts)
    gate_up = module.gate_up if isinstance(module, QuantizedExperts) else module.gate_up.data
    down = module.down if isinstance(module, QuantizedExperts) else module.down.data
    return QuantizedExperts(
        _quantize(gate_up, name, f"{path}.gate_up"),
        _quantize(down, name, f"{path}.down"),
        None if module.gate_up_bias is None else module.gate_up_bias.data,
        None if module.down_bias is None else module.down_bias.data,
        module.activation,
    )


def replace_modules(root: nn.Module, prefix: str, make: Callable[[str, nn.Module], nn.Module | None]) -> None:
    """Replace every submodule for which ``make(path, module)`` returns a new module."""
    for name, module in list(root.named_modules()):
        if not name:
            continue
        new = make(prefix + name, module)
        if new is not None:
            parent_name, _, attr = name.rpartition(".")
            setattr(root.get_submodule(parent_name), attr, new)


def apply_formats(root: nn.Module, plan: FormatPlan, prefix: str = "") -> None:
    """Quantize, in place, every module of ``root`` (at shard path ``prefix``) the plan covers."""

    def make(path: str, module: nn.Module) -> nn.Module | None:
        name = target_format(path, module, plan)
        return None if name is None else quantized_module(path, module, name)

    replace_modules(root, prefix, make)


def apply_embedding_format(root: nn.Module, plan: FormatPlan, tied: bool) -> None:
    """Hold ``root.embed`` (vocab, hidden) in the plan's embeddings format, in place. A plain
    format casts the table; a packed one makes it a :class:`QuantizedEmbedding`, and a plain
    ``root.head`` ``tied`` to it becomes that very weight (one copy; a last shard without the table
    quantizes its own copy of the same tensor the same way, so every cut gives the same logits)."""
    name, embed, head = plan.embeddings, getattr(root, "embed", None), getattr(root, "head", None)
    if name is None:
        return
    if not plan.packed_embeddings:
        if embed is not None:
            root.embed = nn.Parameter(embed.data.to(PLAIN_DTYPES[name]), requires_grad=False)
        return
    table = None if embed is None else _quantize(embed.data, name, "embed")
    if table is not None:
        del root.embed  # a registered parameter until now: torch refuses to assign a module over it
        root.embed = QuantizedEmbedding(table)
    if tied and isinstance(head, Dense):
        root.head = QuantizedDense(table if table is not None else _quantize(head.weight.data, name, "head.weight"))


def prepare_kernels(root: nn.Module, dtype: torch.dtype) -> None:
    """Build each quantized weight's kernel layout for activations of ``dtype`` now, not on the
    first token."""
    for module in root.modules():
        if is_quantized(module):
            for weight in module.quantized_weights().values():  # type: ignore[operator]
                weight.prepare_for(torch.empty(0, dtype=dtype, device=weight.device))


def resident_tensors(root: nn.Module) -> Iterator[tuple[str, str, int]]:
    """(path, format, bytes) of every weight held resident; shared storage counted once."""
    seen: set[tuple[int, int]] = set()
    seen_weights: set[int] = set()
    # embeddings first: a head tied to them holds the same weight, counted once, as the embeddings
    modules = sorted(root.named_modules(), key=lambda item: role_of(item[0]) != "embeddings")
    for path, module in modules:
        dot = f"{path}." if path else ""
        if is_quantized(module) or isinstance(module, QuantizedEmbedding):
            for name, weight in module.quantized_weights().items():
                if id(weight) not in seen_weights:
                    seen_weights.add(id(weight))
                    yield f"{dot}{name}", weight.format, weight.nbytes
        packed = getattr(module, "packed_nbytes", 0)
        if packed:  # a oneDNN layout replaced the bf16 weight(s)
            yield f"{dot}{'weight' if isinstance(module, Dense) else 'gate_up'}", "bf16", packed
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if tensor is None or tensor.numel() == 0:
                continue
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
            if key in seen:
                continue
            seen.add(key)
            fmt = DTYPE_FORMATS.get(tensor.dtype, str(tensor.dtype).removeprefix("torch."))
            yield f"{dot}{name}", fmt, tensor.numel() * tensor.element_size()


def bytes_by_role(root: nn.Module) -> dict[str, dict[str, int]]:
    """{role: {format: resident bytes}} over a shard (roles as in :mod:`engine.formats.plan`)."""
    table: dict[str, dict[str, int]] = {}
    for path, fmt, nbytes in resident_tensors(root):
        by_format = table.setdefault(role_of(path), {})
        by_format[fmt] = by_format.get(fmt, 0) + nbytes
    return table


__all__ = [
    "QuantizedDense",
    "QuantizedEmbedding",
    "QuantizedExperts",
    "apply_embedding_format",
    "apply_formats",
    "bytes_by_role",
    "is_quantized",
    "prepare_kernels",
    "quantized_module",
    "replace_modules",
    "target_format",
]
