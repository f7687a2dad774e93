"""A shard: the layers [layer_start, layer_end) of a model, plus the embedding when it is first
and the final norm and head when it is last, with its own per-slot KV state.

``forward(frame)`` returns float32 hidden states [R, *residual_shape] ([R, hidden] for most
families, engine.residual) to pass to the next shard, or,
for the last shard, float32 logits [N, vocab] of the frame's output rows (all R rows when the
frame names none). Loading reads only the tensors this shard owns. A Shard is the torch
:class:`~modelfleet.engine.backend.StageBackend`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from .cache_layout import REWIND_SLACK_POSITIONS, LayerCache, cache_layout
from .checkpoint import Checkpoint, TensorSource
from .errors import CapacityError, InputError, ModelfleetError
from .expert_store import banks_to
from .formats.plan import FormatPlan
from .frame import Frame, Segment, segments_of
from .kvcache import LayerKV, SlotState, SlotTable
from .layers import Dense, Experts, FrameContext, RMSNorm
from .models import family as family_module
from .quantize import QuantizedEmbedding, apply_embedding_format, apply_formats, bytes_by_role, prepare_kernels
from .quantized_checkpoint import QuantizedCheckpoint, fill_quantized, open_checkpoint
from .residual import residual_shape
from .spec import ModelSpec, load_spec
from .tensor_parallel import TensorGroup, check_tensor_split, split_for_rank
from .weights import LayerWeights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise InputError(f"dtype {name!r} is not supported; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


class FrameSteps(Protocol):
    """Runs a decode-only frame as a fixed-shape step (:class:`~.static_decode.StaticSteps`), or
    returns None to leave it to the general path."""

    def run(self, frame: Frame) -> torch.Tensor | None: ...


class Shard(nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        layer_start: int,
        layer_end: int,
        layers: list[nn.Module],
        embed: torch.Tensor | None,
        norm: RMSNorm | None,
        head: Dense | None,
        device: torch.device,
        dtype: torch.dtype,
    ):
        super().__init__()
        self.spec, self.layer_start, self.layer_end = spec, layer_start, layer_end
        self.layers = nn.ModuleList(layers)
        self.embed: nn.Parameter | QuantizedEmbedding | None = (
            None if embed is None else nn.Parameter(embed, requires_grad=False)
        )
        self.norm, self.head = norm, head
        self.embed_norm: RMSNorm | None = None  # a family's norm of the embedded tokens (adapt_shard)
        self.device, self.dtype = device, dtype
        self.slots: SlotTable | None = None
        self.kv: list[LayerKV] = []
        self.tensor: TensorGroup | None = None  # set when the layers hold one rank's share
        # the family's residual at the ends (DeepSeek-V4's hyper-connection streams): the first
        # shard's entry takes the embedding [R, hidden] to the residual [R, *residual_shape];
        # the last shard's exit takes the residual back to [R, hidden] before the final norm
        self.entry: nn.Module | None = None
        self.exit: nn.Module | None = None
        self.residual_shape: tuple[int, ...] = residual_shape(spec)
        # the last shard keeps its frame's final hidden rows for a proposer that reads them
        # (engine.speculative.mtp): "normed" after the final norm (Inkling's MTP), "residual" the
        # last layer's output as it is (DeepSeek-V4's hyper-connection streams); "" keeps none
        self.keep_hidden = ""
        self.last_hidden: torch.Tensor | None = None
        # a stage's decode-only frames as fixed-shape steps (CUDA graphs), set by
        # engine.backend.load_backend; None: every frame runs the general path
        self.static_steps: FrameSteps | None = None
        # called with each general frame before its layers run (engine.expert_prefetch: the
        # expert stores' prefetch of what the frame's token ids route to)
        self.before_step: list[Callable[[Frame], None]] = []

    @property
    def is_first(self) -> bool:
        return self.layer_start == 0

    @property
    def is_last(self) -> bool:
        return self.layer_end == self.spec.num_layers

    @property
    def weights_bytes(self) -> int:
        """Bytes of every weight held resident: plain, packed for oneDNN, or in a format."""
        return sum(n for by_format in self.bytes_by_role.values() for n in by_format.values())

    @property
    def bytes_by_role(self) -> dict[str, dict[str, int]]:
        """{role: {format: bytes}}: experts, attention, head, embeddings and other (norms, routers)."""
        return bytes_by_role(self)

    def pack_for_cpu(self) -> None:
        """Reorder bf16 projections and experts into oneDNN's layout (faster small-batch matmuls)."""
        for module in self.modules():
            if isinstance(module, Dense | Experts):
                module.pack_for_cpu()

    @property
    def kv_bytes(self) -> int:
        return sum(kv.nbytes for kv in self.kv)

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        layer_start: int = 0,
        layer_end: int | None = None,
        *,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = torch.float32,
        progress: bool = False,
        checkpoint: Checkpoint | None = None,
        pack: bool | None = None,
        formats: FormatPlan | None = None,
        on_layer: Callable[[int, int], None] | None = None,
        tensor: TensorGroup | None = None,
        experts_on_host: bool = False,
    ) -> Shard:
        spec = load_spec(model_dir)
        ckpt = checkpoint or open_checkpoint(model_dir, spec.raw)
        return cls.from_checkpoint(
            spec,
            ckpt,
            layer_start,
            layer_end,
            device=device,
            dtype=dtype,
            progress=progress,
            pack=pack,
            formats=formats,
            on_layer=on_layer,
            tensor=tensor,
            experts_on_host=experts_on_host,
        )

    @classmethod
    def from_checkpoint(
        cls,
        spec: ModelSpec,
        ckpt: TensorSource,
        layer_start: int = 0,
        layer_end: int | None = None,
        *,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = torch.float32,
        progress: bool = False,
        pack: bool | None = None,
        formats: FormatPlan | None = None,
        on_layer: Callable[[int, int], None] | None = None,
        tensor: TensorGroup | None = None,
        experts_on_host: bool = False,
    ) -> Shard:
        """Build a shard from any tensor source (a checkpoint directory or tensors in memory).

        ``formats`` quantizes each layer right after it is built (so at most one layer is ever
        held in the compute dtype); None keeps every weight in the compute dtype, or as a
        checkpoint stores it packed. A quantized checkpoint loads its stored formats as they are.
        ``tensor`` keeps this rank's share of each layer (split right after it is built, before
        it is quantized or packed; a quantized checkpoint's shard is split once it is filled).
        ``experts_on_host`` moves each layer's routed-expert bank to host memory as soon as the
        layer is built (a device cap then places them, :mod:`.expert_offload`): the device never
        holds more than one layer's bank (a quantized checkpoint's: until it is filled).
        """
        end = spec.num_layers if layer_end is None else layer_end
        if not 0 <= layer_start < end <= spec.num_layers:
            raise InputError(
                f"layer range [{layer_start}, {end}) is invalid for a model of {spec.num_layers} layers; "
                f"need 0 <= layer_start < layer_end <= {spec.num_layers}"
            )
        torch_device, torch_dtype = torch.device(device), resolve_dtype(dtype)
        if torch_device.type == "cuda" and not torch.cuda.is_available():
            raise InputError("device 'cuda' was asked for but no CUDA GPU is available; use --device cpu")
        if tensor is not None:
            check_tensor_split(spec, tensor.size)
        if isinstance(ckpt, QuantizedCheckpoint):
            shard = cls._load_quantized(spec, ckpt, layer_start, end, torch_device, torch_dtype, formats, on_layer)
            if tensor is not None:
                split_for_rank(shard, tensor)
                shard.tensor = tensor
            if experts_on_host:
                banks_to(shard, torch.device("cpu"))
            return shard._prepare(pack)
        family = family_module(spec.family)
        source = getattr(family, "tensor_source", None)  # a family reading more than one naming scheme
        root = LayerWeights(ckpt if source is None else source(spec, ckpt), "", torch_dtype, torch_device)
        layers = []
        for i in _progress(range(layer_start, end), progress, f"loading layers [{layer_start}, {end})"):
            layer = family.build_layer(spec, i, root.sub(f"model.layers.{i}."))
            if tensor is not None:
                split_for_rank(layer, tensor, f"layers.{i - layer_start}.")
            if formats is not None:
                apply_formats(layer, formats, f"layers.{i - layer_start}.")
            if experts_on_host:
                banks_to(layer, torch.device("cpu"))
            layers.append(layer)
            if on_layer is not None:
                on_layer(len(layers), end - layer_start)
        embed = root.get("model.embed_tokens.weight") if layer_start == 0 else None
        norm = head = None
        if end == spec.num_layers:
            norm = RMSNorm(root.get("model.norm.weight"), spec.rms_norm_eps)
            head_name = "head.weight" if "head.weight" in root else "lm_head.weight"  # DeepSeek-V4: head
            if spec.tie_word_embeddings or head_name not in root:
                head_name = "model.embed_tokens.weight"
            head = Dense(root.get(head_name) if embed is None or head_name != "model.embed_tokens.weight" else embed)
        shard = cls(spec, layer_start, end, layers, embed, norm, head, torch_device, torch_dtype)
        shard.tensor = tensor
        _attach_residual_ends(shard, family, root)
        if hasattr(family, "adapt_shard"):
            family.adapt_shard(spec, shard, root.sub("model."))
        if formats is not None:
            tied = head is not None and head_name == "model.embed_tokens.weight"
            apply_embedding_format(shard, formats, tied)
            apply_formats(shard, formats)  # the head: every layer is done already
        return shard._prepare(pack)

    @classmethod
    def _load_quantized(
        cls,
        spec: ModelSpec,
        ckpt: QuantizedCheckpoint,
        layer_start: int,
        layer_end: int,
        device: torch.device,
        dtype: torch.dtype,
        formats: FormatPlan | None,
        on_layer: Callable[[int, int], None] | None,
    ) -> Shard:
        """A skeleton on the meta device from the source's names and shapes, filled with the
        stored tensors: nothing is quantized again (kernel layouts are left to ``_prepare``)."""
        if formats is not None and formats != ckpt.plan:
            raise InputError(
                f"{ckpt.dir} is already quantized as {ckpt.plan.to_json()}; load it without formats "
                f"(asked for {formats.to_json()}), or quantize the source checkpoint instead"
            )
        shard = cls.from_checkpoint(
            spec, ckpt.skeleton, layer_start, layer_end, device="meta", dtype=dtype, pack=False, on_layer=on_layer
        )
        fill_quantized(shard, ckpt, layer_start, device)
        shard.device = device
        return shard

    def _prepare(self, pack: bool | None) -> Shard:
        """Kernel layouts: oneDNN packing for plain bf16 on CPU, each format's own layout."""
        cpu_bf16 = self.device.type == "cpu" and self.dtype == torch.bfloat16
        if cpu_bf16 if pack is None else pack:  # oneDNN's packed layout: faster small-batch matmuls
            self.pack_for_cpu()
        if pack is not False and self.device.type != "meta":
            prepare_kernels(self, self.dtype)
        return self

    # ---- KV state -------------------------------------------------------------------------

    def cache_layouts(self) -> list[LayerCache]:
        """What each of this shard's layers caches (this rank's share), as the model family says."""
        size = 1 if self.tensor is None else self.tensor.size
        return [cache_layout(self.spec, i).for_rank(size) for i in range(self.layer_start, self.layer_end)]

    def kv_bytes_per_position(self) -> int:
        """Bytes one more position of one stream costs over every layer's entries kept at full
        context (windowed entries cost nothing more once their window is full)."""
        item = torch.empty((), dtype=self.dtype).element_size()
        return sum(
            e.values_per_row * item // e.stride
            for layout in self.cache_layouts()
            for e in layout.entries.values()
            if e.window is None
        )

    def allocate_cache(
        self,
        max_slots: int,
        max_context: int,
        kv_budget_bytes: int | None = None,
        rewind_slack: int = REWIND_SLACK_POSITIONS,
    ) -> None:
        """Size per-slot state; windowed entries keep only window + rewind_slack positions."""
        if max_slots < 1 or max_context < 1:
            raise CapacityError(f"max_slots={max_slots} and max_context={max_context} must both be >= 1")
        if max_context > self.spec.max_position_embeddings:
            raise CapacityError(
                f"max_context={max_context} exceeds the model's max_position_embeddings="
                f"{self.spec.max_position_embeddings}"
            )
        layouts = self.cache_layouts()
        item = torch.empty((), dtype=self.dtype).element_size()
        need = sum(layout.nbytes(max_slots, max_context, item) for layout in layouts)
        if kv_budget_bytes is not None and need > kv_budget_bytes:
            raise CapacityError(
                f"KV cache for {max_slots} slots x {max_context} positions needs {need} bytes, over the "
                f"shard's budget of {kv_budget_bytes} bytes; lower max_slots or max_context, or raise the budget"
            )
        self.kv = [layout.state(max_slots, max_context, self.dtype, self.device, rewind_slack) for layout in layouts]
        limits = [n for layout in layouts if (n := layout.rewind_limit(max_context, rewind_slack)) is not None]
        self.slots = SlotTable(max_slots, max_context, min(limits) if limits else None)

    def _slots(self) -> SlotTable:
        if self.slots is None:
            self.allocate_cache(max_slots=1, max_context=min(self.spec.max_position_embeddings, 4096))
        assert self.slots is not None
        return self.slots

    def acquire(self) -> int:
        return self._slots().acquire()

    def release(self, slot: int) -> None:
        self._slots().release(slot)

    def rewind(self, slot: int, position: int) -> None:
        self._slots().rewind(slot, position)

    def export_slot(self, slot: int) -> SlotState:
        """The slot's stream as it is here: its length and every layer's stored rows (CPU copies)."""
        length = self._slots().length(slot)
        layers = tuple({name: t[slot].to("cpu", copy=True) for name, t in kv.tensors.items()} for kv in self.kv)
        return SlotState(length, layers)

    def import_slot(self, slot: int, state: SlotState) -> None:
        """Make ``slot`` hold a stream exported from a shard of the same layers and cache sizes."""
        table = self._slots()
        table._check_slot(slot)
        if len(state.layers) != len(self.kv):
            raise CapacityError(f"slot state has {len(state.layers)} layers; this shard caches {len(self.kv)}")
        for kv, stored in zip(self.kv, state.layers, strict=True):
            for name, t in kv.tensors.items():
                if name not in stored or stored[name].shape != t[slot].shape:
                    got = None if name not in stored else list(stored[name].shape)
                    raise CapacityError(
                        f"slot state's {name!r} has shape {got}; this shard stores {list(t[slot].shape)}"
                    )
        for kv, stored in zip(self.kv, state.layers, strict=True):
            for name, t in kv.tensors.items():
                t[slot].copy_(stored[name])
        table.claim(slot)
        table.lengths[slot] = state.length

    # ---- compute --------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, frame: Frame) -> torch.Tensor:
        if frame.decode_only and self.static_steps is not None and (out := self.static_steps.run(frame)) is not None:
            return out
        slots, positions = frame.slots.tolist(), frame.positions.tolist()
        segments = segments_of(slots, positions)
        self.check_segments(segments)
        for hook in self.before_step:
            hook(frame)
        x = self._input(frame)
        ids = None if frame.token_ids is None else frame.token_ids.to(self.device)
        x = self.run_layers(x, FrameContext(segments, frame.positions.to(self.device), token_ids=ids))
        self.commit_segments(segments)
        if self.keep_hidden == "residual":
            self.last_hidden = x
        elif self.keep_hidden and self.norm is not None:
            self.last_hidden = self.norm(x if self.exit is None else self.exit(x))
        if frame.output_rows is not None and self.head is not None:
            x = x[frame.output_rows.to(self.device)]
        return self.output(x)

    def refusals(self, frame: Frame) -> dict[int, ModelfleetError]:
        """The slots whose rows this shard would refuse (a gap in positions, no room in the
        context), each with its reason; the rest of the frame can be computed without them."""
        refused: dict[int, ModelfleetError] = {}
        table = self._slots()
        for seg in segments_of(frame.slots.tolist(), frame.positions.tolist()):
            try:
                table.check_segment(seg.slot, seg.pos_start, seg.rows)
            except ModelfleetError as exc:
                refused[seg.slot] = exc
        return refused

    def check_segments(self, segments: list[Segment]) -> None:
        table = self._slots()
        for seg in segments:
            table.check_segment(seg.slot, seg.pos_start, seg.rows)

    def commit_segments(self, segments: list[Segment]) -> None:
        table = self._slots()
        for seg in segments:
            table.claim(seg.slot)
            table.lengths[seg.slot] = seg.pos_end

    def run_layers(self, x: torch.Tensor, ctx: FrameContext) -> torch.Tensor:
        for layer, kv in zip(self.layers, self.kv, strict=True):
            x = layer(x, ctx, kv)
        return x

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """float32 residuals for the next shard, or float32 logits from the last."""
        if self.norm is None or self.head is None:
            return x.to(torch.float32)
        if self.exit is not None:
            x = self.exit(x)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits.to(torch.float32)

    def _input(self, frame: Frame) -> torch.Tensor:
        if frame.token_ids is not None:  # embedded here, or read by a layer that routes by token
            self._check_vocabulary(frame.token_ids)
        if self.embed is None:
            if frame.hidden is None:
                raise InputError(f"shard [{self.layer_start}, {self.layer_end}) takes hidden states, got none")
            if tuple(frame.hidden.shape[1:]) != self.residual_shape:
                raise InputError(
                    f"frame.hidden has rows of shape {list(frame.hidden.shape[1:])}; this model's residual rows "
                    f"are {list(self.residual_shape)} (engine.residual.residual_shape)"
                )
            return frame.hidden.to(self.device, self.dtype)
        if frame.token_ids is None:
            raise InputError("the first shard takes token ids, got none")
        return self.residual_of(frame.token_ids.to(self.device))

    def _check_vocabulary(self, ids: torch.Tensor) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.spec.vocab_size):
            bad = next(t for t in ids.tolist() if not 0 <= t < self.spec.vocab_size)
            raise InputError(f"token id {bad} is outside the vocabulary [0, {self.spec.vocab_size})")

    def residual_of(self, ids: torch.Tensor) -> torch.Tensor:
        """[R] token ids on the device -> the first layer's residual [R, *residual_shape]."""
        x = self.embed_tokens(ids)
        return x if self.entry is None else self.entry(x)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """[R] token ids on the device -> [R, hidden] in the compute dtype (the table may be stored narrower)."""
        assert self.embed is not None
        if isinstance(self.embed, QuantizedEmbedding):
            embedded: torch.Tensor = self.embed(ids, self.dtype)
        else:
            embedded = self.embed[ids].to(self.dtype)
        return embedded if self.embed_norm is None else self.embed_norm(embedded)


def _attach_residual_ends(shard: Shard, family: object, root: LayerWeights) -> None:
    """The family's residual entry (first shard) and exit (last shard), where it has them."""
    entry, exit_ = getattr(family, "residual_entry", None), getattr(family, "residual_exit", None)
    if entry is not None and shard.is_first:
        shard.entry = entry(shard.spec)
    if exit_ is not None and shard.is_last:
        shard.exit = exit_(shard.spec, root)


def _progress(items: range, show: bool, label: str):  # type: ignore[no-untyped-def]
    if not show:
        return items
    from rich.console import Console
    from rich.progress import track

    return track(items, description=label, console=Console(stderr=True))
