"""Tensor parallelism inside one pipeline stage (Megatron-style), applied as a transformation pass.

:func:`split_for_rank` takes built decoder layers and keeps, on rank r of ``size``, 1/size of
every attention's heads and of every feed-forward block's intermediate width (each routed expert,
shared experts, dense MLPs). Attention's output and the feed-forward block's output (routed plus
shared experts) are then partial sums; one all-reduce after each (a forward hook on the
``attention`` and ``mlp`` modules, so module paths, weight roles and formats are untouched)
makes every rank's residual stream whole again. Embeddings, norms, routers and the head stay
replicated: every rank takes the same frame and returns the same output.

Use: each rank of a stage calls ``group = init_tensor_group(rank, size, address, port, device)``,
then ``LocalModel.load(..., tensor=group)`` or ``Shard.load(..., tensor=group)``, and runs the
same frames as every other rank, in the same order (each reduce is a collective).

Invariants:

- rank r keeps contiguous blocks: q heads [r*Hq/s, (r+1)*Hq/s) and the kv heads those read,
  [r*Hkv/s, (r+1)*Hkv/s); intermediate units [r*I/s, (r+1)*I/s) of gate, up and down;
- the fused ``qkv`` keeps [q rows; k rows; v rows] and an expert's ``gate_up`` keeps
  [gate rows; up rows] (GPT-OSS included: its interleaved checkpoint layout is de-interleaved
  at load, before any split), so layers run unchanged on the smaller shapes;
- a bias added after a partial sum (``o_proj``'s, ``down``'s) is kept on rank 0 only, so the
  reduce adds it once;
- splitting happens before oneDNN packing and kernel preparation (a packed module is refused);
  a quantized weight is cut with :meth:`QuantizedWeight.slice`, which refuses to cut a block;
- latent attention (DeepSeek-V3's MLA) splits its heads (q_up's and kv_up's rows, o_proj's
  columns); its latent cache is shared by every head, so each rank holds all of it;
- DeepSeek-V4's compressed attention splits its query heads and the output groups they form;
  its K=V head, compressors, indexer and their state are shared, so each rank holds all of them;
- Inkling's attention splits its heads, its k/v convolutions' channels following their kv heads;
  the convolutions on the residual branch run after the reduce, on the whole hidden state;
- a size-1 group changes nothing.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .errors import InputError
from .formats import FormatError, QuantizedWeight
from .formats.storage import from_storage, storage_tensors
from .layers import Attention, DecoderLayer, Dense, Experts, GatedMLP, SparseMoE
from .models import family as family_module
from .models.deepseek_v3 import LatentAttention
from .models.deepseek_v4_attention import CompressedAttention
from .models.inkling import InklingAttention
from .quantize import QuantizedDense, QuantizedExperts
from .spec import ModelSpec

Rows = list[tuple[int, int]]  # (start, length) blocks, kept in order


@dataclass(frozen=True)
class TensorGroup:
    """This process's place in a tensor-parallel group: ``rank`` of ``size``.

    ``process_group`` is the torch.distributed group the ranks reduce over (None: the default
    group, as :func:`init_tensor_group` makes it).
    """

    rank: int
    size: int
    process_group: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise InputError(f"tensor rank {self.rank} is outside a group of size {self.size}; need 0 <= rank < size")

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the group, in place when ``t`` is contiguous; returns the sum."""
        if self.size == 1:
            return t
        t = t.contiguous()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.process_group)
        return t


def init_tensor_group(
    rank: int, size: int, address: str, port: int, device: str | torch.device = "cpu", timeout_seconds: float = 120.0,
    namespace: str = "",
) -> TensorGroup:  # fmt: skip
    """Join the group of ``size`` ranks meeting at tcp://address:port (gloo on CPU, nccl on
    CUDA); the group becomes this process's default torch.distributed group.

    Rank 0 hosts the rendezvous (torch's TCPStore) on ``address`` only, not on every interface.
    The store itself has no authentication: ``namespace`` (a secret every rank derives from the
    fleet's keys) prefixes every key the group writes, so a peer that can reach the port but
    lacks the secret can neither read the ranks' addresses nor plant its own."""
    group = TensorGroup(rank, size)
    if size == 1:
        return group
    torch_device = torch.device(device)
    if torch_device.type == "cuda" and torch_device.index is not None:
        torch.cuda.set_device(torch_device)
    host = f"[{address}]" if ":" in address else address
    timeout = timedelta(seconds=timeout_seconds)
    try:
        store: Any = _rendezvous_store(rank, size, address, port, timeout)
        if namespace:
            store = dist.PrefixStore(namespace, store)
        backend = "nccl" if torch_device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    except (RuntimeError, ValueError, OSError) as exc:  # torch's DistStoreError is a RuntimeError
        raise InputError(
            f"tensor rank {rank} of {size} could not join the group at tcp://{host}:{port} within "
            f"{timeout_seconds:g}s: {exc}; check that every rank uses the same address, port and size"
        ) from exc
    return group


def _rendezvous_store(rank: int, size: int, address: str, port: int, timeout: timedelta) -> Any:
    """torch's TCPStore; rank 0's server listens on a socket bound to ``address`` (TCPStore alone binds all)."""
    if rank != 0:
        return dist.TCPStore(address, port, size, is_master=False, timeout=timeout)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.create_server((address, port), family=family)
    return dist.TCPStore(address, port, size, is_master=True, timeout=timeout, master_listen_fd=listener.detach())


def close_tensor_group() -> None:
    """Leave the default group :func:`init_tensor_group` joined (no-op when none was joined)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def tensor_split_fields(spec: ModelSpec) -> list[tuple[str, int]]:
    """The config fields (name, value) a tensor size must divide: the heads, or what the family
    names instead (``tensor_split_fields``), and Inkling's sliding layers' heads where present."""
    fields = getattr(family_module(spec.family), "tensor_split_fields", None)  # a family that splits otherwise
    pairs = [("num_attention_heads", spec.num_heads), ("num_key_value_heads", spec.num_kv_heads)]
    split = list(pairs if fields is None else fields(spec))
    for field in ("swa_num_attention_heads", "swa_num_key_value_heads"):  # Inkling's sliding layers
        if spec.get(field) is not None:
            split.append((field, int(spec.raw[field])))
    return split


def check_tensor_split(spec: ModelSpec, size: int) -> None:
    """Refuse, before any weight is read, a model whose heads do not split over ``size`` ranks."""
    if size == 1:
        return
    for field, value in tensor_split_fields(spec):
        per_rank(value, field, size, "config.json")


def per_rank(value: int, field: str, size: int, where: str) -> int:
    if value % size:
        raise InputError(
            f"tensor parallelism over {size} ranks splits {field}, but {where} has {field}={value}, "
            f"which is not divisible by {size}; choose a tensor size that divides {value}"
        )
    return value // size


def split_for_rank(root: nn.Module, group: TensorGroup, prefix: str = "") -> None:
    """Keep, in place, this rank's share of every decoder layer under ``root`` (at shard path
    ``prefix``) and reduce each attention and feed-forward output over ``group``."""
    if group.size == 1:
        return
    for path, module in list(root.named_modules()):
        if isinstance(module, DecoderLayer):
            split_layer(module, group, f"{prefix}{path}".rstrip("."))


def is_split(root: nn.Module) -> bool:
    """Whether any decoder layer under ``root`` holds one rank's share of a group of 2 or more."""
    return any(getattr(m, "tensor_group", None) is not None for m in root.modules() if isinstance(m, DecoderLayer))


def split_layer(layer: DecoderLayer, group: TensorGroup, path: str) -> None:
    if getattr(layer, "tensor_group", None) is not None:
        raise InputError(f"{path} is already split for tensor parallelism; split a layer once")
    _split_attention(layer.attention, group, f"{path}.attention")
    _split_feed_forward(layer.mlp, group, f"{path}.mlp")
    for module in (layer.attention, layer.mlp):
        module.register_forward_hook(_reduce_output(group))
    setattr(layer, "tensor_group", group)  # noqa: B010 (a marker of the pass, not a DecoderLayer field)


def _reduce_output(group: TensorGroup) -> Callable[[nn.Module, Any, torch.Tensor], torch.Tensor]:
    def hook(_module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
        return group.all_reduce(output)

    return hook


def _split_attention(a: nn.Module, group: TensorGroup, path: str) -> None:
    if isinstance(a, LatentAttention):
        _split_latent_attention(a, group, path)
        return
    if isinstance(a, CompressedAttention):
        _split_compressed_attention(a, group, path)
        return
    if isinstance(a, InklingAttention):
        _split_inkling_attention(a, group, path)
        return
    if not isinstance(a, Attention):
        raise InputError(f"{path} is {type(a).__name__}, which tensor parallelism cannot split")
    hq = per_rank(a.num_heads, "num_attention_heads", group.size, path)
    hkv = per_rank(a.num_kv_heads, "num_key_value_heads", group.size, path)
    d, r = a.head_dim, group.rank
    k_start, v_start = a.num_heads * d, (a.num_heads + a.num_kv_heads) * d
    # qkv rows: [q heads; k heads; v heads] -> this rank's q, k and v heads, in that order
    _keep_rows(a.qkv, [(r * hq * d, hq * d), (k_start + r * hkv * d, hkv * d), (v_start + r * hkv * d, hkv * d)], path)
    _keep_columns(a.o_proj, r * hq * d, hq * d, group.rank == 0, f"{path}.o_proj")
    if a.qk_norm_weight is not None:  # [Hq + Hkv, D]
        a.qk_norm_weight = _param(_take(a.qk_norm_weight, 0, [(r * hq, hq), (a.num_heads + r * hkv, hkv)]))
    if a.sinks is not None:  # [Hq]
        a.sinks = _param(_take(a.sinks, 0, [(r * hq, hq)]))
    a.num_heads, a.num_kv_heads = hq, hkv


def _split_latent_attention(a: LatentAttention, group: TensorGroup, path: str) -> None:
    """Heads h of q_up ([H * (nope + rope), q_rank]), kv_up ([H * (nope + v), kv_rank]) and
    o_proj's input ([hidden, H * v]); the down projections and their norms are shared by all heads."""
    heads = per_rank(a.num_heads, "num_attention_heads", group.size, path)
    start = group.rank * heads
    q_dim, kv_dim = a.nope_dim + a.rope_dim, a.nope_dim + a.v_dim
    _keep_rows(a.q_up, [(start * q_dim, heads * q_dim)], f"{path}.q_up")
    _keep_rows(a.kv_up, [(start * kv_dim, heads * kv_dim)], f"{path}.kv_up")
    _keep_columns(a.o_proj, start * a.v_dim, heads * a.v_dim, group.rank == 0, f"{path}.o_proj")
    a.num_heads = heads


def _split_compressed_attention(a: CompressedAttention, group: TensorGroup, path: str) -> None:
    """DeepSeek-V4: query heads (q_up's rows, sinks) and the output groups those heads form
    (wo_a's rows, wo_b's columns); the K=V head, compressors and indexer are shared by all heads."""
    heads = per_rank(a.num_heads, "num_attention_heads", group.size, path)
    groups = per_rank(a.o_groups, "o_groups", group.size, path)
    rank_width = _out_features(a.o_groups_proj) // a.o_groups  # o_lora_rank
    start, d = group.rank * heads, a.head_dim
    _keep_rows(a.q_up, [(start * d, heads * d)], f"{path}.q_up")
    _keep_rows(a.o_groups_proj, [(group.rank * groups * rank_width, groups * rank_width)], f"{path}.o_groups_proj")
    _keep_columns(a.o_proj, group.rank * groups * rank_width, groups * rank_width, group.rank == 0, f"{path}.o_proj")
    a.sinks = _param(_take(a.sinks, 0, [(start, heads)]))
    a.num_heads, a.o_groups = heads, groups


def _split_inkling_attention(a: InklingAttention, group: TensorGroup, path: str) -> None:
    """Heads of q_proj and r_proj ([H * D] and [H * d_rel] rows), kv heads of k_proj, v_proj and
    of their convolutions' channels ([Hkv * D]), o_proj's input columns; the q/k norms and the
    relative bank are shared by every head."""
    hq = per_rank(a.num_heads, "num_attention_heads (swa_num_attention_heads on sliding layers)", group.size, path)
    hkv = per_rank(a.num_kv_heads, "num_key_value_heads (swa_ on sliding layers)", group.size, path)
    d, d_rel, r = a.head_dim, _out_features(a.r_proj) // a.num_heads, group.rank
    _keep_rows(a.q_proj, [(r * hq * d, hq * d)], f"{path}.q_proj")
    _keep_rows(a.r_proj, [(r * hq * d_rel, hq * d_rel)], f"{path}.r_proj")
    for name in ("k_proj", "v_proj"):
        _keep_rows(getattr(a, name), [(r * hkv * d, hkv * d)], f"{path}.{name}")
    for conv in (a.k_conv, a.v_conv):  # [Hkv * D, kernel]: channels follow their heads
        conv.weight = _param(_take(conv.weight, 0, [(r * hkv * d, hkv * d)]))
    _keep_columns(a.o_proj, r * hq * d, hq * d, group.rank == 0, f"{path}.o_proj")
    a.num_heads, a.num_kv_heads = hq, hkv


def _split_feed_forward(m: nn.Module, group: TensorGroup, path: str) -> None:
    if isinstance(m, SparseMoE):
        _split_experts(m.experts, group, f"{path}.experts")
        if m.shared is not None:
            _split_feed_forward(m.shared, group, f"{path}.shared")
    elif isinstance(m, GatedMLP):
        inter = _out_features(m.gate)
        share = per_rank(inter, "intermediate_size", group.size, path)
        start = group.rank * share
        _keep_rows(m.gate, [(start, share)], f"{path}.gate")
        _keep_rows(m.up, [(start, share)], f"{path}.up")
        _keep_columns(m.down, start, share, group.rank == 0, f"{path}.down")
    elif isinstance(m, Experts | QuantizedExperts):  # shared experts held as a bank (Inkling's)
        _split_experts(m, group, path)
    else:
        raise InputError(f"{path} is {type(m).__name__}, which tensor parallelism cannot split")


def _split_experts(e: nn.Module, group: TensorGroup, path: str) -> None:
    """gate_up [E, 2I, H] as [gate; up] -> [gate share; up share]; down [E, H, I] -> its columns."""
    if not isinstance(e, Experts | QuantizedExperts):
        raise InputError(f"{path} is {type(e).__name__}, which tensor parallelism cannot split")
    if isinstance(e, Experts) and e.packed is not None:
        raise InputError(f"{path} is already packed for oneDNN; split it for tensor parallelism before packing")
    inter = e.gate_up.shape[1] // 2
    share = per_rank(inter, "intermediate size (moe_intermediate_size, or intermediate_size)", group.size, path)
    start = group.rank * share
    rows = [(start, share), (inter + start, share)]
    if isinstance(e, QuantizedExperts):
        e.gate_up = _quantized_rows(e.gate_up, rows, f"{path}.gate_up")
        e.down = _quantized_columns(e.down, start, share, f"{path}.down")
    else:
        e.gate_up = _param(_take(e.gate_up, 1, rows))
        e.down = _param(_take(e.down, 2, [(start, share)]))
    if e.gate_up_bias is not None:  # [E, 2I]
        e.gate_up_bias = _param(_take(e.gate_up_bias, 1, rows))
    if e.down_bias is not None and group.rank != 0:
        e.down_bias = None  # added once, by rank 0, before the reduce


def _keep_rows(module: nn.Module, rows: Rows, path: str) -> None:
    """Output rows of a projection (Dense or QuantizedDense), bias alike."""
    if isinstance(module, QuantizedDense):
        module.weight = _quantized_rows(module.weight, rows, f"{path}.weight")
    elif isinstance(module, Dense):
        _check_plain(module, path)
        module.weight = _param(_take(module.weight, 0, rows))
    else:
        raise InputError(f"{path} is {type(module).__name__}, which tensor parallelism cannot split")
    if module.bias is not None:
        module.bias = _param(_take(module.bias, 0, rows))


def _keep_columns(module: nn.Module, start: int, length: int, keep_bias: bool, path: str) -> None:
    """Input columns [start, start + length) of a projection whose output is reduced afterwards."""
    if isinstance(module, QuantizedDense):
        module.weight = _quantized_columns(module.weight, start, length, f"{path}.weight")
    elif isinstance(module, Dense):
        _check_plain(module, path)
        module.weight = _param(_take(module.weight, 1, [(start, length)]))
    else:
        raise InputError(f"{path} is {type(module).__name__}, which tensor parallelism cannot split")
    if not keep_bias:
        module.bias = None


def _check_plain(module: Dense, path: str) -> None:
    if module.packed is not None:
        raise InputError(f"{path} is already packed for oneDNN; split it for tensor parallelism before packing")


def _out_features(module: Dense | QuantizedDense) -> int:
    return int(module.weight.shape[-2])


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def _take(t: torch.Tensor, dim: int, rows: Rows) -> torch.Tensor:
    """The blocks of ``dim`` in order, as a tensor of its own (the whole one can be freed)."""
    return torch.cat([t.narrow(dim, start, length) for start, length in rows], dim=dim).contiguous()


def _quantized_rows(weight: QuantizedWeight, rows: Rows, path: str) -> QuantizedWeight:
    """Row blocks of a quantized weight (out is dim -2), joined into one weight of its format."""
    dim = len(weight.shape) - 2
    try:
        parts = [weight.slice(dim, start, start + length) for start, length in rows]
        if len(parts) == 1:
            return parts[0]
        # every format stores rows along the same dim as its logical shape (see formats.storage)
        stored = [storage_tensors(p) for p in parts]
        return from_storage(weight.format, {name: torch.cat([s[name] for s in stored], dim=dim) for name in stored[0]})
    except FormatError as exc:
        raise FormatError(f"cannot split {path} ({weight.format}) for tensor parallelism: {exc}") from exc


def _quantized_columns(weight: QuantizedWeight, start: int, length: int, path: str) -> QuantizedWeight:
    try:
        return weight.slice(-1, start, start + length)
    except FormatError as exc:
        raise FormatError(f"cannot split {path} ({weight.format}) for tensor parallelism: {exc}") from exc


__all__ = [
    "TensorGroup",
    "check_tensor_split",
    "tensor_split_fields",
    "close_tensor_group",
    "init_tensor_group",
    "is_split",
    "split_for_rank",
]
