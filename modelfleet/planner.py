"""Pure planners: from a checkpoint's sizes and a list of nodes to a FleetPlan.

Decisions are functions on plain data (lists of byte counts, Kubernetes Node objects as dicts),
so the operator and ``modelfleet up`` share them and tests read as tables. Only
:func:`layer_bytes`, :func:`kv_bytes_per_layer` and :func:`build_plan` look at a checkpoint, and
they read its config and safetensors headers, never tensor data; torch and the engine are
imported inside them, so importing this module costs neither.

:func:`assemble_plan` is the one place a FleetPlan is put together from these decisions (ranges,
addresses, devices, sizes, formats, serving limits, backend): ``modelfleet plan``/``up``
(:func:`build_plan`) and the operator (``operator.placement``) both call it.

Layer ranges are half-open ``[layer_start, layer_end)``. The embedding is counted on the first
stage and the final norm + output head on the last. The memory split minimises
``sum_k need_k**2 / usable_k`` under ``need_k <= usable_k``: with layers of equal size this is the
split in proportion to each node's usable memory, and it is solved exactly by dynamic programming
over (stage, first layer), O(stages * layers**2).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, get_args

from .engine.errors import InputError
from .engine.expert_placement import MoELayer, StagePlacement, plan_expert_placement
from .engine.format_names import PACKED_FORMATS
from .engine.split import even_split
from .plan import (
    PORTS_PER_STAGE,
    FleetPlan,
    Formats,
    PlanError,
    ServingLimits,
    StageBackendName,
    StagePlan,
    build,
    stage_port_span,
)

if TYPE_CHECKING:
    from .engine.checkpoint import TensorInfo
    from .engine.spec import ModelSpec

GiB = 1 << 30
# Python, torch, the agent's buffers and the operating system's own needs on each node.
RUNTIME_RESERVE_BYTES = 2 * GiB
DEFAULT_BASE_PORT = 5555
# Local stages' ports are PORT_STRIDE apart (a multiple of it when a stage spans more: plan.stage_port_span),
# a round number above PORTS_PER_STAGE so a stage's ports are easy to read off.
PORT_STRIDE = 10
assert PORT_STRIDE >= PORTS_PER_STAGE

EMBED_NAME, NORM_NAME, HEAD_NAME = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
# a checkpoint written by `modelfleet quantize` names tensors by shard path: embed, layers.N..., norm.weight, head.weight,
# and a packed weight by its storage tensors: embed.weight.codes, head.weight.scales, ...
_QUANTIZED_NAMES = {"embed": EMBED_NAME, "norm.weight": NORM_NAME, "head.weight": HEAD_NAME}
_QUANTIZED_NAMES["embed.weight"] = EMBED_NAME  # DeepSeek-V4's own names: embed.weight, norm.weight, head.weight
_PACKED_NAME = re.compile(r"^(embed|head)\.weight\.[a-z]+$")
_LAYER_NAME = re.compile(r"^(?:model\.)?layers\.(\d+)\.")
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


class InfeasiblePlan(PlanError):
    """The nodes cannot hold the model's weights plus the KV reservation."""

    def __init__(self, message: str, missing_bytes: int, shortfall_bytes: tuple[int, ...]):
        super().__init__(message)
        self.missing_bytes = missing_bytes
        self.shortfall_bytes = shortfall_bytes  # per node, in node order


# ---- sizes from a checkpoint ----------------------------------------------------------------


class TensorIndex(Protocol):
    """What sizing needs of a checkpoint: its tensor names and each one's dtype and shape."""

    def names(self) -> list[str]: ...

    def info(self, name: str) -> TensorInfo: ...


QUANTIZED_FORMATS = PACKED_FORMATS  # the formats a role is quantized into at load (engine.format_names)


def format_bytes(shape: Sequence[int], fmt: str, kernel_layouts: bool = True) -> int:
    """Resident bytes of a float matrix (or bank) of ``shape`` held in weight format ``fmt``, its
    kernel layouts included (the larger of the CPU's and the GPU's; see engine/formats): int4
    stores 32 codes in 16 bytes, an fp16 scale and a 4-bit zero point per group, and on the CPU
    torch's kernel adds a scale/bias pair (2 x bf16) per group; int4_sym has no zero points;
    int8 one byte per value plus a float32 scale and the CPU kernel's bf16 copy per row; mxfp4
    16 bytes and one E8M0 byte per 32 values. Without ``kernel_layouts`` (a table that is only
    looked up) the stored layout alone."""
    rows, width = math.prod(shape[:-1]), shape[-1]
    groups = -(-width // 32)
    kernel = 1 if kernel_layouts else 0
    per_row = {
        "int4": width // 2 + 2 * groups + (groups + 1) // 2 + kernel * 4 * groups,
        "int4_sym": width // 2 + 2 * groups + kernel * 4 * groups,
        "int8": width + 4 + kernel * 2,
        "mxfp4": width // 2 + groups,
    }
    return rows * per_row[fmt]


@dataclass(frozen=True)
class LayerBytes:
    """Weight bytes of a checkpoint, per decoder layer and for the parts around them.

    ``role_bytes`` holds, per layer, the bytes of the plain float matrices a weight format would
    hold, by ``"role/format"`` (``experts/plain``, ``experts/int4``, ``attention/int8``, ...);
    ``outer_role_bytes`` the same for the embedding table (``embeddings/...``) and an untied
    output head (``head/...``). :meth:`in_formats` uses them to count a checkpoint quantized at
    load; a tied head is the embedding table, held in its format.
    """

    per_layer: tuple[int, ...]
    embed_bytes: int
    norm_bytes: int  # the final norm
    head_matrix_bytes: int  # lm_head, or the embedding again when tied
    tied: bool
    role_bytes: tuple[Mapping[str, int], ...] = ()
    outer_role_bytes: Mapping[str, int] = field(default_factory=dict)

    def in_formats(self, formats: Formats | None) -> LayerBytes:
        """The bytes once each role in a (non-plain) weight format is held in it at load."""
        if formats is None or not self.role_bytes:
            return self

        def delta(table: Mapping[str, int], role: str, fmt: str) -> int:
            if fmt not in QUANTIZED_FORMATS:
                return 0
            return table.get(f"{role}/{fmt}", 0) - table.get(f"{role}/plain", 0)

        per_layer = tuple(
            size + delta(table, "experts", formats.experts) + delta(table, "attention", formats.attention)
            for size, table in zip(self.per_layer, self.role_bytes, strict=True)
        )
        embed = self.embed_bytes + delta(self.outer_role_bytes, "embeddings", formats.embeddings)
        if self.tied:
            head = embed if formats.embeddings in QUANTIZED_FORMATS else self.head_matrix_bytes
        else:
            head = self.head_matrix_bytes + delta(self.outer_role_bytes, "head", formats.head)
        return LayerBytes(per_layer, embed, self.norm_bytes, head, self.tied)

    @property
    def head_bytes(self) -> int:
        """What the last stage holds beyond its layers: final norm + output head."""
        return self.norm_bytes + self.head_matrix_bytes

    def stage_bytes(self, layer_start: int, layer_end: int) -> int:
        first, last = layer_start == 0, layer_end == len(self.per_layer)
        total = sum(self.per_layer[layer_start:layer_end])
        total += self.embed_bytes if first else 0
        if last:  # a single stage with tied weights holds the one matrix once
            total += self.norm_bytes + (0 if first and self.tied else self.head_matrix_bytes)
        return total


def layer_bytes(model_dir: str | Path, dtype: str | None = None) -> LayerBytes:
    """Sizes from config.json and safetensors headers only (no tensor data is read).

    With ``dtype`` (float32, bfloat16, float16), floating tensors are counted at that element size,
    as the shard converts them on load; otherwise at their stored size. Tensors of layers at or past
    ``num_hidden_layers`` (e.g. multi-token-prediction layers) are not served and not counted.
    """
    from .engine.checkpoint import Checkpoint
    from .engine.spec import load_spec

    return layer_bytes_of(load_spec(model_dir), Checkpoint(model_dir), dtype)


def layer_bytes_of(spec: ModelSpec, checkpoint: TensorIndex, dtype: str | None = None) -> LayerBytes:
    """:func:`layer_bytes` of a parsed config and a tensor index (a directory's or a Hub repository's)."""
    from .engine.models import family

    view = getattr(family(spec.family), "tensor_source", None)
    if view is not None:  # a family's own checkpoint layout, listed by transformers' names
        checkpoint = view(spec, checkpoint)
    # a quantized checkpoint is loaded as stored: its bytes are the resident bytes
    itemsize = None if spec.raw.get("quantization_config") else _itemsize(dtype)
    per_layer = [0] * spec.num_layers
    role_bytes: list[dict[str, int]] = [{} for _ in range(spec.num_layers)]
    named: dict[str, int] = {}
    outer_role_bytes: dict[str, int] = {}
    for name in checkpoint.names():
        info = checkpoint.info(name)
        size = math.prod(info.shape) * itemsize if itemsize and info.dtype.is_floating_point else info.nbytes
        plain_matrix = itemsize is not None and info.dtype.is_floating_point and len(info.shape) >= 2
        match = _LAYER_NAME.match(name)
        if match and int(match.group(1)) < spec.num_layers:
            layer = int(match.group(1))
            per_layer[layer] += size
            role = _layer_role(name[match.end() :])
            if plain_matrix and role is not None:
                shape = tuple(info.shape)
                if _FUSED_EXPERTS.search(name):  # stored [E, in, out]; formats group the input
                    shape = (shape[0], shape[2], shape[1])
                _add_role_bytes(role_bytes[layer], role, shape, size)
        elif (canonical := _source_name(name)) in (EMBED_NAME, NORM_NAME, HEAD_NAME):
            named[canonical] = named.get(canonical, 0) + size  # a packed weight: its storage tensors summed
            if plain_matrix and canonical != NORM_NAME:
                role = "head" if canonical == HEAD_NAME else "embeddings"
                _add_role_bytes(outer_role_bytes, role, info.shape, size)
    tied = spec.tie_word_embeddings or HEAD_NAME not in named
    head = named.get(EMBED_NAME, 0) if tied else named[HEAD_NAME]
    return LayerBytes(
        tuple(per_layer), named.get(EMBED_NAME, 0), named.get(NORM_NAME, 0), head, tied,
        tuple(role_bytes), outer_role_bytes,
    )  # fmt: skip


def _add_role_bytes(table: dict[str, int], role: str, shape: Sequence[int], plain: int) -> None:
    """Add a matrix's bytes, plain and in each format, to ``table``; the embedding table counts
    without kernel layouts (a tied head's matmul adds them on the CPU; not counted)."""
    table[f"{role}/plain"] = table.get(f"{role}/plain", 0) + plain
    for fmt in QUANTIZED_FORMATS:
        nbytes = format_bytes(shape, fmt, kernel_layouts=role != "embeddings")
        table[f"{role}/{fmt}"] = table.get(f"{role}/{fmt}", 0) + nbytes


_FUSED_EXPERTS = re.compile(r"\.experts\.[a-z_]+_proj$")  # GPT-OSS's fused banks, no ".weight"
_ROUTERS = re.compile(r"^(mlp|block_sparse_moe|ffn)\.(gate|router)\.")


def _layer_role(rest: str) -> str | None:
    """Which format role a layer tensor (its name after ``layers.N.``) belongs to, as the engine
    assigns them (engine.formats.plan.role_of): attention projections but DeepSeek's kv_b_proj,
    which stays plain; feed-forward and expert matrices but the routers; None for the rest."""
    if "norm" in rest or rest.endswith(("sinks", "bias")) or "sconv" in rest or "rel_logits_proj" in rest:
        return None  # Inkling's convolution taps and relative banks stay plain too
    if rest.startswith(("self_attn.", "attn.")):  # attn., ffn.: DeepSeek-V4's names
        return None if "kv_b_proj" in rest else "attention"
    if rest.startswith(("mlp.", "block_sparse_moe.", "ffn.")) and not _ROUTERS.match(rest):
        return "experts"
    return None


def _source_name(name: str) -> str:
    """The source checkpoint's name of a quantized checkpoint's tensor (others unchanged)."""
    packed = _PACKED_NAME.match(name)
    if packed:
        return EMBED_NAME if packed.group(1) == "embed" else HEAD_NAME
    return _QUANTIZED_NAMES.get(name, name)


def _itemsize(dtype: str | None) -> int | None:
    if dtype is None:
        return None
    if dtype not in _ITEMSIZE:
        raise PlanError(f"dtype={dtype!r} is not a compute dtype; choose one of {', '.join(_ITEMSIZE)}")
    return _ITEMSIZE[dtype]


def dtype_itemsize(dtype: str) -> int:
    """Bytes of one value in the compute dtype ``dtype``; PlanError naming the choices otherwise."""
    size = _itemsize(dtype)
    assert size is not None
    return size


def kv_bytes_per_layer(spec: ModelSpec, max_streams: int, context_length: int, dtype: str) -> list[int]:
    """KV cache bytes each layer reserves for ``max_streams`` streams of ``context_length`` positions,
    as a loaded shard allocates them: each family's :func:`~modelfleet.engine.models.cache_layout`
    (standard attention's K and V, DeepSeek's MLA latent; a sliding-window layer keeps its window
    plus the rewind slack)."""
    from .engine.cache_layout import cache_layouts

    itemsize = dtype_itemsize(dtype)
    return [layout.nbytes(max_streams, context_length, itemsize) for layout in cache_layouts(spec)]


# ---- node memory ----------------------------------------------------------------------------

_QUANTITY = re.compile(r"^([+-]?(?:\d+(?:\.\d*)?|\.\d+))(?:([KMGTPE]i|[numkMGTPE])|[eE]([+-]?\d+))?$")
_SUFFIX: dict[str, int | Decimal] = {
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"),
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
}  # fmt: skip


def parse_quantity(value: str | int | float) -> int:
    """A Kubernetes quantity ('16Gi', '1.5Gi', '500M', '128974848', '1e9') as an integer, rounded up."""
    return math.ceil(quantity_value(value))


def quantity_value(value: str | int | float) -> Decimal:
    """A Kubernetes quantity's exact value ('500m' is 0.5)."""
    if isinstance(value, bool):
        raise PlanError(f"{value!r} is not a Kubernetes quantity")
    text = str(value).strip()
    match = _QUANTITY.match(text)
    if match is None:
        raise PlanError(f"{value!r} is not a Kubernetes quantity (e.g. '16Gi', '1.5Gi', '500M', '1024')")
    number, suffix, exponent = match.groups()
    try:
        amount = Decimal(number)
    except InvalidOperation as exc:  # the pattern admits only decimal numbers; kept for safety
        raise PlanError(f"{value!r} is not a Kubernetes quantity") from exc
    if suffix:
        amount *= _SUFFIX[suffix]
    elif exponent:
        amount = amount.scaleb(int(exponent))
    return amount


def node_name(node: Mapping[str, Any]) -> str:
    return str((node.get("metadata") or {}).get("name", "<unnamed node>"))


def node_device(node: Mapping[str, Any]) -> str:
    """cuda for NVIDIA GPUs, GPU (OpenVINO) for Intel GPUs, else cpu; from status.allocatable."""
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    if parse_quantity(allocatable.get("nvidia.com/gpu", 0)) > 0:
        return "cuda"
    if any(parse_quantity(allocatable.get(k, 0)) > 0 for k in ("gpu.intel.com/i915", "gpu.intel.com/xe")):
        return "GPU"
    return "cpu"


def usable_memory(node: Mapping[str, Any], runtime_reserve_bytes: int = RUNTIME_RESERVE_BYTES) -> int:
    """Bytes a stage may fill on this node: allocatable memory minus the runtime reserve.

    Integrated GPUs (Intel Arc, through OpenVINO) share host RAM, so they add nothing. Discrete
    NVIDIA GPUs add their memory as published by GPU feature discovery (``nvidia.com/gpu.memory``
    in MiB per GPU, times the allocatable ``nvidia.com/gpu``): weights may live on the device or,
    for experts, in host banks.
    """
    name = node_name(node)
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    if "memory" not in allocatable:
        raise PlanError(f"node {name!r} has no status.allocatable.memory; is it a Kubernetes Node object?")
    try:
        host = parse_quantity(allocatable["memory"])
        gpus = parse_quantity(allocatable.get("nvidia.com/gpu", 0))
        labels = (node.get("metadata") or {}).get("labels") or {}
        gpu_mib = parse_quantity(labels.get("nvidia.com/gpu.memory", 0))
    except PlanError as exc:
        raise PlanError(f"node {name!r}: status.allocatable.memory or a GPU quantity: {exc}") from exc
    return max(0, host + gpus * gpu_mib * 2**20 - runtime_reserve_bytes)


# ---- layer splits ---------------------------------------------------------------------------


def split_even(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """:func:`modelfleet.engine.split.even_split` (the first ``num_layers % stages`` stages hold one
    layer more), raising PlanError."""
    try:
        ranges: list[tuple[int, int]] = even_split(num_layers, stages)
    except InputError as exc:
        raise PlanError(str(exc)) from exc
    return ranges


def _check_counts(num_layers: int, stages: int) -> None:
    split_even(num_layers, stages)


def split_by_memory(
    layer_bytes: Sequence[int],
    embed_bytes: int,
    head_bytes: int,
    usable_bytes_per_node: Sequence[int],
    kv_bytes_per_layer: int | Sequence[int] = 0,
    node_names: Sequence[str] | None = None,
) -> list[tuple[int, int]]:
    """One contiguous layer range per node, in node order, sized to each node's usable memory.

    A layer costs its weights plus its KV reservation; stage 0 also holds ``embed_bytes`` and the
    last stage ``head_bytes``. Raises InfeasiblePlan with the missing bytes and each node's
    shortfall when no split fits.
    """
    num_layers, stages = len(layer_bytes), len(usable_bytes_per_node)
    _check_counts(num_layers, stages)
    kv = [kv_bytes_per_layer] * num_layers if isinstance(kv_bytes_per_layer, int) else list(kv_bytes_per_layer)
    if len(kv) != num_layers:
        raise PlanError(f"kv_bytes_per_layer has {len(kv)} entries for {num_layers} layers")
    prefix = [0]
    for weights, reserve in zip(layer_bytes, kv, strict=True):
        prefix.append(prefix[-1] + weights + reserve)

    def need(k: int, start: int, end: int) -> int:
        return prefix[end] - prefix[start] + (embed_bytes if k == 0 else 0) + (head_bytes if k == stages - 1 else 0)

    usable = list(usable_bytes_per_node)
    ranges = _best_split(num_layers, usable, need, capped=True)
    if ranges is None:
        closest = _best_split(num_layers, usable, need, capped=False)
        assert closest is not None  # without caps every split with >= 1 layer per stage is allowed
        names = list(node_names) if node_names is not None else [f"node {k}" for k in range(stages)]
        raise _infeasible(closest, [need(k, a, b) for k, (a, b) in enumerate(closest)], usable, names)
    return ranges


def _best_split(
    num_layers: int, usable: list[int], need: Callable[[int, int, int], int], capped: bool
) -> list[tuple[int, int]] | None:
    """argmin sum_k need_k**2 / usable_k over contiguous splits, each stage >= 1 layer (DP)."""
    stages, inf = len(usable), math.inf
    # best[k][i]: least cost of stages k.. covering layers [i, num_layers); choice[k][i]: stage k's end.
    best = [[inf] * (num_layers + 1) for _ in range(stages + 1)]
    choice = [[0] * (num_layers + 1) for _ in range(stages)]
    best[stages][num_layers] = 0.0
    for k in range(stages - 1, -1, -1):
        for start in range(k, num_layers - (stages - k) + 1):
            ends = [num_layers] if k == stages - 1 else range(start + 1, num_layers - (stages - k - 1) + 1)
            for end in ends:
                bytes_needed = need(k, start, end)
                if capped and bytes_needed > usable[k]:
                    continue
                cost = best[k + 1][end] + bytes_needed**2 / max(usable[k], 1)
                if cost < best[k][start]:
                    best[k][start], choice[k][start] = cost, end
    if best[0][0] == inf:
        return None
    ranges, start = [], 0
    for k in range(stages):
        ranges.append((start, choice[k][start]))
        start = choice[k][start]
    return ranges


def _infeasible(ranges: list[tuple[int, int]], needs: list[int], usable: list[int], names: list[str]) -> InfeasiblePlan:
    missing = max(0, sum(needs) - sum(usable))
    shortfall = tuple(max(0, n - u) for n, u in zip(needs, usable, strict=True))
    lines = [
        f"{names[k]} (stage {k}, layers [{a}, {b})) needs {needs[k]} bytes, has {usable[k]}, "
        f"short by {shortfall[k]} bytes ({_human(shortfall[k])})"
        for k, (a, b) in enumerate(ranges)
        if shortfall[k] > 0
    ]
    if missing > 0:
        head = (
            f"the fleet cannot hold the model: weights + KV reservation need {sum(needs)} bytes, the nodes "
            f"offer {sum(usable)} usable bytes; {missing} bytes ({_human(missing)}) missing"
        )
    else:
        head = "the nodes offer enough memory in all, but no contiguous split of the layers fits each node"
    fix = "add nodes, lower serving.max_streams or serving.context_length, or choose smaller weight formats"
    return InfeasiblePlan(f"{head}. Per node: {'; '.join(lines)}. Fix: {fix}", missing, shortfall)


def _human(n: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


# ---- expert placement under a device cap ----------------------------------------------------

_EXPERT_NAME = re.compile(r"\.experts\.(\d+)\.")  # one routed expert's matrix (Qwen3-MoE, DeepSeek, Mixtral)


def routed_experts(checkpoint: TensorIndex, num_layers: int, dtype: str, formats: Formats | None) -> list[MoELayer]:
    """Each MoE layer's routed-expert bank as it will be held: expert count and bytes per expert
    in the experts' format (or ``dtype``), from tensor names and shapes only. GPT-OSS's fused
    banks count their leading dimension; a checkpoint already quantized is not sized here."""
    fmt = None if formats is None else formats.experts
    itemsize = _itemsize(dtype) or 4
    found: dict[int, tuple[set[int], int]] = {}
    for name in checkpoint.names():
        match = _LAYER_NAME.match(name)
        if not match or int(match.group(1)) >= num_layers:
            continue
        info = checkpoint.info(name)
        shape = tuple(info.shape)
        expert = _EXPERT_NAME.search(name)
        if expert is not None and len(shape) == 2:
            ids = {int(expert.group(1))}
        elif _FUSED_EXPERTS.search(name) and len(shape) == 3:
            ids, shape = set(range(shape[0])), (shape[0], shape[2], shape[1])
        else:
            continue
        nbytes = (
            format_bytes(shape, fmt) if fmt is not None and fmt in QUANTIZED_FORMATS else math.prod(shape) * itemsize
        )
        seen, total = found.get(int(match.group(1)), (set(), 0))
        found[int(match.group(1))] = (seen | ids, total + nbytes)
    return [MoELayer(layer, len(ids), total // len(ids)) for layer, (ids, total) in sorted(found.items())]


def stage_expert_placement(
    stage: StagePlan, moe: Sequence[MoELayer], device_bytes: int | None, host_bytes: int | None = None
) -> StagePlacement:
    """Where ``stage``'s experts go under a device cap (the agent decides again from the bytes it
    actually loads, with the same function): its weights and KV budget less its routed banks stay
    on the device. Raises InputError naming both sizes when neither side can hold them."""
    layers = [m for m in moe if stage.layer_start <= m.layer < stage.layer_end]
    other = stage.weights_bytes - sum(m.bank_bytes for m in layers) + stage.kv_budget_bytes
    return plan_expert_placement(layers, other, device_bytes, host_bytes)


def expert_placements(
    plan: FleetPlan, model_dir: str | Path, host_bytes: Sequence[int | None] | None = None
) -> dict[tuple[int, int], StagePlacement]:
    """{(group, stage): placement} under the plan's ``serving.gpu_memory_bytes`` ({} when not
    capped); ``host_bytes``: each stage's host memory, group after group (None: unchecked).
    Raises PlanError naming the stage and both sizes when a stage fits neither side."""
    cap = plan.serving.gpu_memory_bytes
    if cap is None:
        return {}
    from .engine.checkpoint import Checkpoint

    moe = routed_experts(Checkpoint(model_dir), plan.model.num_layers, plan.model.dtype, plan.model.formats)
    out = {}
    stages = [(g.group_index, s) for g in plan.groups for s in g.stages]
    for i, (g, stage) in enumerate(stages):
        host = None if host_bytes is None else host_bytes[i]
        try:
            out[(g, stage.stage_index)] = stage_expert_placement(stage, moe, cap, host)
        except InputError as exc:
            raise PlanError(f"group {g} stage {stage.stage_index} (serving.gpu_memory_bytes): {exc}") from exc
    return out


# ---- combinations refused at plan time --------------------------------------------------------
# Each returns one line naming the option, the limit and the fix (or None), so ``plan``, ``up`` and the
# operator refuse a fleet before any stage starts rather than inside every stage with a traceback.

# without an asked context length: the model's positions, at most this many (vLLM caps by memory)
DEFAULT_CONTEXT_CAP = 4096
TORCH_DEVICE = re.compile(r"^(cpu|cuda(:[0-9]+)?)$")


def context_length_for(max_positions: int, asked: int | None, option: str = "--context-length") -> int:
    """The plan's context length: ``asked`` if the model has that many positions (``max_positions``,
    config.json's max_position_embeddings), else (nothing asked) ``max_positions`` capped at
    DEFAULT_CONTEXT_CAP. Raises PlanError naming both when ``asked`` is over the model's limit."""
    if asked is None:
        return min(max_positions, DEFAULT_CONTEXT_CAP)
    if (why := context_refusal(max_positions, asked, option)) is not None:
        raise PlanError(f"{why}, or leave {option} out to get {min(max_positions, DEFAULT_CONTEXT_CAP)}")
    return asked


def context_refusal(max_positions: int, asked: int, option: str) -> str | None:
    """Why ``asked`` positions per stream are more than the model has (or None)."""
    if asked <= max_positions:
        return None
    return (
        f"{option} {asked} is over the model's max_position_embeddings={max_positions}; ask for at most {max_positions}"
    )


def device_refusal(device: str, cuda_devices: int | None, option: str = "--device") -> str | None:
    """Why torch stages cannot run on ``device`` (or None). ``cuda_devices``: the CUDA devices this
    machine has, or None where the stages run elsewhere (then only the name is checked)."""
    if TORCH_DEVICE.match(device) is None:
        return f"{option} {device!r} is not a device; choose cpu, cuda or cuda:N (N counts from 0)"
    if cuda_devices is None or device == "cpu":
        return None
    if cuda_devices == 0:
        return f"{option} {device}: this machine has no CUDA device (torch sees none); use {option} cpu"
    index = int(device.partition(":")[2] or 0)
    if index >= cuda_devices:
        return f"{option} {device}: this machine has {cuda_devices} CUDA device(s), cuda:0..cuda:{cuda_devices - 1}"
    return None


def tensor_refusal(split_fields: Sequence[tuple[str, int]], tensor: int, option: str = "--tensor") -> str | None:
    """Why ``tensor`` ranks cannot split a model whose config has ``split_fields`` (name, value),
    the counts tensor parallelism divides (engine.tensor_parallel.tensor_split_fields), or None."""
    for name, value in split_fields:
        if value % tensor:
            sizes = [n for n in range(1, value + 1) if all(v % n == 0 for _, v in split_fields)]
            return (
                f"{option} {tensor} does not divide the model's {name}={value}; "
                f"choose a tensor size from {', '.join(map(str, sizes))}"
            )
    return None


def local_cuda_devices() -> int:
    """CUDA devices this machine's torch sees (0 without a GPU or without a CUDA build)."""
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


# ---- the whole plan -------------------------------------------------------------------------


def assemble_plan(
    model: Mapping[str, Any],
    ranges: Sequence[Sequence[tuple[int, int]]],
    sizes: LayerBytes,
    kv_bytes: Sequence[int],
    address_of: Callable[[int, int], str],
    device_of: Callable[[int, int], str] = lambda g, s: "cpu",
    *,
    tp_size: int = 1,
    backend: str | Sequence[str] = "torch",
    serving: ServingLimits | Mapping[str, Any] | None = None,
) -> FleetPlan:
    """The FleetPlan of ``ranges`` (per group, per stage: ``(layer_start, layer_end)``), the one
    assembler. ``model``: the plan's ``model`` fields; ``sizes`` give each stage's
    ``weights_bytes`` and ``kv_bytes`` (per layer) its ``kv_budget_bytes``; ``address_of(g, s)``
    and ``device_of(g, s)`` place stage ``s`` of group ``g``; every stage gets ``tp_size`` and
    ``backend`` (one name for all, or one per stage: a fleet may mix backends, since only float32
    residuals cross between stages). Raises PlanError naming the field when the result is not a valid plan."""
    per_stage = [stage_backends(backend, len(stages)) for stages in ranges]
    groups = [
        {"group_index": g, "stages": [
            {
                "stage_index": s, "layer_start": a, "layer_end": b, "tp_size": tp_size, "backend": per_stage[g][s],
                "address": address_of(g, s), "device": device_of(g, s),
                "weights_bytes": sizes.stage_bytes(a, b), "kv_budget_bytes": sum(kv_bytes[a:b]),
            }
            for s, (a, b) in enumerate(stages)
        ]}
        for g, stages in enumerate(ranges)
    ]  # fmt: skip
    return build(model=dict(model), groups=groups, serving=serving if serving is not None else ServingLimits())


def stage_backends(backend: str | Sequence[str], stages: int) -> list[str]:
    """One backend name per stage from ``torch``, ``torch,openvino`` or a list; PlanError naming
    the field when the count or a name is wrong."""
    backends = get_args(StageBackendName)
    names = [b.strip() for b in backend.split(",")] if isinstance(backend, str) else list(backend)
    if len(names) == 1:
        names = names * stages
    if len(names) != stages:
        raise PlanError(f"backend lists {len(names)} backends for {stages} stages; give one, or one per stage")
    unknown = sorted({n for n in names if n not in backends})
    if unknown:
        raise PlanError(f"backend {', '.join(unknown)} is unknown; choose from {', '.join(backends)}")
    return names


def local_address(base_port: int, stages: int, tp_size: int = 1) -> Callable[[int, int], str]:
    """Addresses of a fleet on this machine: stage ports from ``base_port``, group after group,
    PORT_STRIDE apart (a multiple of it when a stage of ``tp_size`` ranks spans more ports)."""
    stride = PORT_STRIDE * -(-stage_port_span(tp_size) // PORT_STRIDE)
    return lambda g, s: f"127.0.0.1:{base_port + stride * (g * stages + s)}"


def build_plan(
    model_dir: str | Path,
    stages: int,
    nodes: Sequence[Mapping[str, Any]] | None = None,
    *,
    groups: int = 1,
    tensor: int = 1,
    dtype: str = "bfloat16",
    device: str = "cpu",
    backend: str = "torch",
    served_name: str | None = None,
    model_path: str | None = None,
    formats: Formats | None = None,
    serving: ServingLimits | None = None,
    address_of: Callable[[int, int], str] | None = None,
    runtime_reserve_bytes: int = RUNTIME_RESERVE_BYTES,
    cuda_devices: int | None = None,
) -> FleetPlan:
    """A plan of ``groups`` pipeline replicas of ``stages`` stages each, ``tensor`` ranks a stage.

    Without ``nodes`` the layers are split evenly and every stage runs on ``device``. With
    ``nodes`` (Kubernetes Node objects, ``stages`` per group, group after group) each group's
    layers are split by the nodes' usable memory and each stage runs on its node's device. Each
    group's stages reserve KV for its share of ``serving.max_streams`` (rounded up) at
    ``serving.context_length``. ``backend``: one backend for every stage, or a comma-separated
    list of one per stage (``torch,openvino``). ``cuda_devices`` (this machine's, when the stages
    run here) lets a CUDA ``device`` be checked against what exists; combinations the stages would
    refuse (a device, a tensor size that does not divide the heads, a context past the model's
    positions) raise PlanError in one line.
    """
    from .engine.spec import load_spec

    if groups < 1:
        raise PlanError(f"groups={groups} must be >= 1")
    spec = load_spec(model_dir)
    limits = serving or ServingLimits(context_length=context_length_for(spec.max_position_embeddings, None))
    # with nodes, each stage's device is its node's (node_device), named by the planner itself
    # OpenVINO names its own devices (CPU, GPU, GPU.N): engine.backend checks those at stage start
    torch_devices = [device] if nodes is None and not (backend != "torch" and device.upper().startswith("GPU")) else []
    _refuse_combinations(spec, limits, tensor, torch_devices, cuda_devices)
    sizes = layer_bytes(model_dir, dtype).in_formats(formats)
    kv = kv_bytes_per_layer(spec, -(-limits.max_streams // groups), limits.context_length, dtype)
    if nodes is not None and len(nodes) != stages * groups:
        raise PlanError(f"{len(nodes)} nodes given for {groups} group(s) of {stages} stages; need {stages * groups}")
    members = [None if nodes is None else list(nodes[g * stages : (g + 1) * stages]) for g in range(groups)]
    ranges = [_group_ranges(sizes, kv, stages, m, runtime_reserve_bytes) for m in members]
    model = {
        "path": model_path or str(Path(model_dir).resolve()), "served_name": served_name or Path(model_dir).name,
        "family": spec.family, "num_layers": spec.num_layers, "dtype": dtype,
        "formats": formats or stored_formats(spec.raw, dtype) or Formats(),
    }  # fmt: skip

    def device_of(g: int, s: int) -> str:
        group_nodes = members[g]
        return device if group_nodes is None else node_device(group_nodes[s])

    address = address_of or local_address(DEFAULT_BASE_PORT, stages, tensor)
    plan = assemble_plan(model, ranges, sizes, kv, address, device_of, tp_size=tensor, backend=backend, serving=limits)
    hosts = None if nodes is None else [usable_memory(node, runtime_reserve_bytes) for node in nodes]
    expert_placements(plan, model_dir, hosts)  # a stage neither side can hold fails here, at plan time
    return plan


def stored_formats(raw_config: Mapping[str, Any], dtype: str) -> Formats | None:
    """The formats a checkpoint quantized by ``modelfleet quantize`` is served in (what it stores;
    its plain roles in the compute ``dtype``), so the plan records what runs; None for any other."""
    from .engine.formats.plain import PLAIN_DTYPES
    from .engine.quantized_checkpoint import stored_plan
    from .engine.shard import resolve_dtype

    stored = stored_plan(dict(raw_config))
    if stored is None:
        return None
    plain = next(name for name, torch_dtype in PLAIN_DTYPES.items() if torch_dtype == resolve_dtype(dtype))
    return Formats.model_validate({role: getattr(stored, role) or plain for role in Formats.model_fields})


def _refuse_combinations(
    spec: ModelSpec, serving: ServingLimits, tensor: int, devices: Sequence[str], cuda_devices: int | None
) -> None:
    """build_plan's one-line refusals (device_refusal, tensor_refusal, context_length_for)."""
    for device in dict.fromkeys(devices):
        if (why := device_refusal(device, cuda_devices)) is not None:
            raise PlanError(why)
    if tensor > 1:
        from .engine.tensor_parallel import tensor_split_fields  # imports torch: only when ranks split

        if (why := tensor_refusal(tensor_split_fields(spec), tensor)) is not None:
            raise PlanError(why)
    context_length_for(spec.max_position_embeddings, serving.context_length, "serving.context_length")


def _group_ranges(
    sizes: LayerBytes, kv: list[int], stages: int, members: list[Mapping[str, Any]] | None, reserve: int
) -> list[tuple[int, int]]:
    if members is None:
        return split_even(len(sizes.per_layer), stages)
    usable = [usable_memory(node, reserve) for node in members]
    # one stage holding a tied embedding and head holds that matrix once
    head = sizes.norm_bytes if stages == 1 and sizes.tied else sizes.head_bytes
    names = [node_name(node) for node in members]
    return split_by_memory(sizes.per_layer, sizes.embed_bytes, head, usable, kv, names)
