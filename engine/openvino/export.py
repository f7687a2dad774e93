"""From a torch layer's feed-forward block to the expert bank one OpenVINO graph holds.

Banks are built from the engine's own weights, as the torch backend holds them: plain float
tensors, or int4 (group 32) with the packed nibbles, u4 zero points and fp16 scales kept as they
are (no requantization). Layout: expert-major, gate and up [E, I, H], down [E, H, I].

- A routed bank splits its [gate; up] rows into gate and up.
- Shared experts (DeepSeek) and dense blocks (Eq. 2, seed 000 §3.4) become all-active slices of
  the expert width I: gate/up rows and down columns [j*I, (j+1)*I) at quantization-group
  boundaries (I is a multiple of 32), so a dense block is the sum of its slices, each with weight 1.
  Shared slices follow the routed experts (ids E, E+1, ...), always selected.
- The layer attenuation A = 2^n (Eq. 1) divides the up projection (its fp16 scales for int4);
  :func:`bank_peak` is what chooses n (:func:`.ranges.layer_exponent`).
- A dense block may instead stay whole (:func:`dense_weights`) for three compressed matmuls,
  the faster form on CPUs (:func:`.stage.dense_form`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..errors import ConfigError
from ..formats.base import BLOCK, pack_nibbles
from ..formats.int4 import Int4Weight
from ..layers import Dense, Experts, GatedMLP, silu_glu
from ..quantize import QuantizedDense, QuantizedExperts
from .graphs import ExpertBank, Weight
from .ranges import expert_peak

BANK_FORMATS = ("float", "int4", "int4_sym")  # what an OpenVINO expert bank holds


def _weight_of(module: nn.Module, what: str) -> Weight:
    if isinstance(module, QuantizedDense):
        if not isinstance(module.weight, Int4Weight) or module.bias is not None:
            raise ConfigError(
                f"{what}: the OpenVINO backend takes feed-forward weights as float or int4 without bias; got "
                f"{module.weight.format}; use --experts int4 (or no quantization)"
            )
        return module.weight
    if isinstance(module, Dense) and module.bias is None and module.packed is None:
        return module.weight.detach().to(torch.float32)
    raise ConfigError(f"{what}: {type(module).__name__} is not a projection the OpenVINO backend exports")


def routed_bank(experts: nn.Module, what: str) -> ExpertBank:
    """The routed experts of a SwiGLU bank (plain or int4), split into gate, up and down."""
    if isinstance(experts, QuantizedExperts):
        if not isinstance(experts.gate_up, Int4Weight) or not isinstance(experts.down, Int4Weight):
            raise ConfigError(
                f"{what}: experts in format {experts.format!r}; the OpenVINO backend exports "
                f"{', '.join(BANK_FORMATS)} (use --experts int4)"
            )
        gate_up: Weight = experts.gate_up
        down: Weight = experts.down
    elif isinstance(experts, Experts) and experts.packed is None:
        gate_up, down = experts.gate_up.detach().to(torch.float32), experts.down.detach().to(torch.float32)
    else:
        raise ConfigError(f"{what}: {type(experts).__name__} is not an expert bank the OpenVINO backend exports")
    if experts.gate_up_bias is not None or experts.down_bias is not None or experts.activation is not silu_glu:
        raise ConfigError(
            f"{what}: the OpenVINO MoE graph is SwiGLU without biases; this bank has biases or another GLU"
        )
    width = int(gate_up.shape[-2]) // 2
    return ExpertBank(_rows(gate_up, 0, width), _rows(gate_up, width, 2 * width), down)


def slices_of(mlp: GatedMLP, width: int, what: str) -> ExpertBank:
    """A dense SwiGLU block [gate, up: (D, H); down: (H, D)] as D / width all-active slices (Eq. 2)."""
    gate, up, down = (_weight_of(m, f"{what}.{n}") for m, n in ((mlp.gate, "gate"), (mlp.up, "up"), (mlp.down, "down")))
    total = int(gate.shape[0])
    if total % width or width % BLOCK:
        raise ConfigError(
            f"{what}: dense width {total} is not a multiple of the expert width {width} (itself a multiple of "
            f"{BLOCK}), so it cannot be cut into expert slices at quantization-group boundaries"
        )
    bounds = [(j, j + width) for j in range(0, total, width)]
    return ExpertBank(
        stack([_rows(gate, a, b) for a, b in bounds]),
        stack([_rows(up, a, b) for a, b in bounds]),
        stack([_columns(down, a, b) for a, b in bounds]),
    )


def dense_weights(mlp: GatedMLP, what: str) -> ExpertBank:
    """A dense SwiGLU block whole (gate, up [D, H], down [H, D]), for three compressed matmuls."""
    gate, up, down = (_weight_of(m, f"{what}.{n}") for m, n in ((mlp.gate, "gate"), (mlp.up, "up"), (mlp.down, "down")))
    return ExpertBank(gate, up, down)


def _float(w: Weight) -> torch.Tensor:
    return w.detach().to(torch.float32) if isinstance(w, torch.Tensor) else w.dequantize()


def _expert(w: Weight, e: int) -> torch.Tensor:
    return w[e].detach().to(torch.float32) if isinstance(w, torch.Tensor) else w.expert(e).dequantize()


def bank_peak(bank: ExpertBank, rows: torch.Tensor) -> float:
    """The largest value Eq. 1's attenuation divides over every expert of ``bank`` (or the whole
    block of :func:`dense_weights`) for ``rows``, float32, one expert decoded at a time."""
    if len(bank.gate.shape) == 2:
        return expert_peak(_float(bank.gate), _float(bank.up), _float(bank.down), rows)
    peaks = [
        expert_peak(_expert(bank.gate, e), _expert(bank.up, e), _expert(bank.down, e), rows)
        for e in range(bank.num_experts)
    ]
    return max(peaks)


def _rows(w: Weight, start: int, end: int) -> Weight:
    if isinstance(w, torch.Tensor):
        return w[..., start:end, :].clone()
    return w.slice(-2, start, end)


def _columns(w: Weight, start: int, end: int) -> Weight:
    if isinstance(w, torch.Tensor):
        return w[..., start:end].clone()
    return w.slice(-1, start, end)


def _asymmetric(w: Int4Weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes, scales and packed zero points of any int4 weight (int4_sym: z = 8 made explicit)."""
    return w.codes, w.scales, pack_nibbles(w.zero_points())


def stack(parts: Sequence[Weight]) -> Weight:
    """[out, in] weights (or [e, out, in] banks) of one kind -> one bank [sum e, out, in]."""
    tensors = [p for p in parts if isinstance(p, torch.Tensor)]
    if len(tensors) == len(parts):
        return torch.cat([t if t.dim() == 3 else t[None] for t in tensors])
    if not all(isinstance(p, Int4Weight) for p in parts):
        raise ConfigError("an OpenVINO expert bank cannot mix float and int4 experts; quantize the experts role whole")
    pieces = [_asymmetric(p) for p in parts]  # type: ignore[arg-type]
    codes, scales, zeros = ([t if t.dim() == 3 else t[None] for t in kind] for kind in zip(*pieces, strict=True))
    return Int4Weight(torch.cat(codes), torch.cat(scales), torch.cat(zeros))


def join(banks: Sequence[ExpertBank]) -> ExpertBank:
    """Experts of several banks of one width in one bank, in order (routed first, then shared)."""
    return ExpertBank(stack([b.gate for b in banks]), stack([b.up for b in banks]), stack([b.down for b in banks]))


def attenuate(bank: ExpertBank, exponent: int) -> ExpertBank:
    """The bank with its up projection divided by 2^exponent (Eq. 1's A; exact in fp16 scales
    unless a scale falls into the subnormal range)."""
    if exponent == 0:
        return bank
    factor = float(2**exponent)
    up = bank.up
    if isinstance(up, torch.Tensor):
        return ExpertBank(bank.gate, up / factor, bank.down)
    codes, scales, zeros = _asymmetric(up)  # type: ignore[arg-type]
    return ExpertBank(bank.gate, Int4Weight(codes, (scales.float() / factor).to(torch.float16), zeros), bank.down)


def bank_format(bank: ExpertBank) -> str:
    return "int4" if isinstance(bank.gate, Int4Weight) else "fp32"
