"""Quantized checkpoints: a shard's weights written in their formats, and read back without
quantizing again.

On disk (``modelfleet quantize`` writes it; ``Shard.load`` recognises it by config.json):

- ``config.json``: the source config plus ``quantization_config`` =
  ``{"quant_method": "modelfleet", "version": 1, "formats": {role: format | null},
  "dtype": the dtype the weights were quantized from}``.
- ``model-XXXXX-of-YYYYY.safetensors`` + ``model.safetensors.index.json``: tensors named by
  their path in a whole-model :class:`~engine.shard.Shard`, with global layer indices:
  a plain parameter is ``{module path}.{parameter}`` (``embed``, ``norm.weight``,
  ``layers.3.input_norm.weight``, ``layers.3.attention.qkv.bias``); a quantized projection is
  ``{module path}.weight.{storage}`` and a quantized bank ``{module path}.gate_up.{storage}``
  and ``.down.{storage}``, with the storage names of :mod:`engine.formats.storage`
  (``layers.3.mlp.experts.gate_up.codes``, ``.scales``, ``.zeros``); packed embeddings are
  ``embed.weight.{storage}``. A head tied to the embeddings (left plain, or sharing packed
  embeddings' weight) is not written: it is tied again at load.
- ``source_tensors.json``: ``{"tensors": {source name: {"dtype", "shape"}}}``, the source
  checkpoint's names and shapes, from which the family builders make a skeleton on the meta
  device (no memory) that the stored tensors then fill: the same module tree as quantizing at
  load, by the same :func:`engine.quantize.target_format` decisions, so the same tokens.
- tokenizer files, copied.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .checkpoint import DTYPES, Checkpoint
from .errors import CheckpointError
from .formats import FormatError
from .formats.plan import FormatPlan
from .formats.storage import STORAGE, from_storage, storage_tensors
from .layers import Dense, Experts
from .quantize import QuantizedDense, QuantizedEmbedding, QuantizedExperts, replace_modules, target_format

QUANT_METHOD = "modelfleet"
VERSION = 1
SOURCE_INDEX = "source_tensors.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
FILE_BYTES = 2 << 30  # tensors per safetensors file, at most (one larger tensor gets a file alone)
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def stored_plan(raw_config: dict[str, Any]) -> FormatPlan | None:
    """The plan a modelfleet-quantized checkpoint was written with; None for any other."""
    config = raw_config.get("quantization_config")
    if not isinstance(config, dict) or config.get("quant_method") != QUANT_METHOD:
        return None
    if config.get("version") != VERSION:
        raise CheckpointError(f"quantization_config version {config.get('version')!r} is not {VERSION}")
    try:
        return FormatPlan.from_json(config.get("formats"))
    except FormatError as exc:
        raise CheckpointError(f"config.json quantization_config.formats: {exc}") from exc


class SkeletonSource:
    """Source tensor names with meta tensors of their shapes: what builders need, no bytes."""

    def __init__(self, index: dict[str, dict[str, Any]]):
        self.index = index

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def read(self, name: str) -> torch.Tensor:
        if name not in self.index:
            raise CheckpointError(f"tensor {name!r} is not in {SOURCE_INDEX}")
        entry = self.index[name]
        return torch.empty(entry["shape"], dtype=DTYPES[entry["dtype"]], device="meta")


class QuantizedCheckpoint(Checkpoint):
    """A checkpoint directory written by :func:`save_quantized`."""

    def __init__(self, model_dir: str | Path, plan: FormatPlan):
        super().__init__(model_dir)
        self.plan = plan
        path = self.dir / SOURCE_INDEX
        try:
            self.skeleton = SkeletonSource(json.loads(path.read_text())["tensors"])
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{path}: missing or corrupt ({exc}); a quantized checkpoint needs it") from exc


def open_checkpoint(model_dir: str | Path, raw_config: dict[str, Any]) -> Checkpoint:
    plan = stored_plan(raw_config)
    return Checkpoint(model_dir) if plan is None else QuantizedCheckpoint(model_dir, plan)


# ---- reading ----------------------------------------------------------------------------------


def global_path(path: str, layer_start: int) -> str:
    """A shard-local path (``layers.0.…`` is the shard's first layer) -> the whole-model one."""
    parts = path.split(".")
    if parts[0] == "layers" and len(parts) > 1:
        parts[1] = str(int(parts[1]) + layer_start)
    return ".".join(parts)


def _read_weight(ckpt: Checkpoint, name: str, fmt: str, device: torch.device) -> Any:
    tensors = {t: ckpt.read(f"{name}.{t}").to(device) for t in STORAGE[fmt] if f"{name}.{t}" in ckpt}
    try:
        return from_storage(fmt, tensors)
    except FormatError as exc:
        raise CheckpointError(f"{ckpt.dir}: stored weight {name!r} ({fmt}) is corrupt: {exc}") from exc


def fill_quantized(root: nn.Module, ckpt: QuantizedCheckpoint, layer_start: int, device: torch.device) -> None:
    """Make a meta skeleton real: quantized modules from their stored formats, then every
    parameter and buffer from its stored tensor (in the skeleton's dtype, on ``device``)."""

    def make(path: str, module: nn.Module) -> nn.Module | None:
        fmt = target_format(path, module, ckpt.plan, keep_same_dtype=False)
        if fmt is None and isinstance(module, QuantizedExperts):
            fmt = module.format  # packed in the source (GPT-OSS MXFP4) and stored as is
        name = global_path(path, layer_start)
        first = "gate_up" if isinstance(module, QuantizedExperts | Experts) else "weight"
        if fmt is None or f"{name}.{first}.{STORAGE[fmt][0]}" not in ckpt:
            return None  # plain: its parameters are filled below, like every other tensor
        if isinstance(module, Dense):
            return QuantizedDense(_read_weight(ckpt, f"{name}.weight", fmt, device), _bias(module.bias))
        return QuantizedExperts(
            _read_weight(ckpt, f"{name}.gate_up", fmt, device),
            _read_weight(ckpt, f"{name}.down", fmt, device),
            _bias(getattr(module, "gate_up_bias", None)),
            _bias(getattr(module, "down_bias", None)),
            module.activation,  # type: ignore[arg-type]
        )

    _fill_packed_embeddings(root, ckpt, device)
    replace_modules(root, "", make)
    _fill_tensors(root, ckpt, layer_start, device)


def _fill_packed_embeddings(root: nn.Module, ckpt: QuantizedCheckpoint, device: torch.device) -> None:
    """Packed embeddings from ``embed.weight.*``, and a head tied to them (no ``head.weight``
    of its own stored) as that same weight, or, on a last shard without the table, a copy of it."""
    fmt = ckpt.plan.embeddings
    if fmt is None or not ckpt.plan.packed_embeddings or f"embed.weight.{STORAGE[fmt][0]}" not in ckpt:
        return  # a plain table (or none at all) is filled like every other tensor
    head_stored = "head.weight" in ckpt or any(f"head.weight.{t}" in ckpt for s in STORAGE.values() for t in s)
    tied_head = isinstance(getattr(root, "head", None), Dense) and not head_stored
    if getattr(root, "embed", None) is None and not tied_head:
        return
    table = _read_weight(ckpt, "embed.weight", fmt, device)
    if getattr(root, "embed", None) is not None:
        del root.embed  # the skeleton's meta parameter: torch refuses to assign a module over it
        root.embed = QuantizedEmbedding(table)
    if tied_head:
        root.head = QuantizedDense(table)


def _bias(param: torch.Tensor | None) -> torch.Tensor | None:
    return None if param is None else param.data


def _fill_tensors(root: nn.Module, ckpt: Checkpoint, layer_start: int, device: torch.device) -> None:
    for path, module in root.named_modules():
        dot = f"{path}." if path else ""
        for kind, table in (("parameter", module._parameters), ("buffer", module._buffers)):
            for name, tensor in list(table.items()):
                if tensor is None or tensor.device.type != "meta":
                    continue
                stored = global_path(f"{dot}{name}", layer_start)
                embed = getattr(root, "embed", None)  # filled first: the root's own tensors come first
                if stored == "head.weight" and stored not in ckpt and embed is not None:
                    table[name] = embed  # a tied head, stored once as the embeddings
                    continue
                if stored == "head.weight" and stored not in ckpt and "embed" in ckpt:
                    stored = "embed"  # a tied head on a last shard that does not hold the embeddings
                if stored not in ckpt:
                    raise CheckpointError(f"{ckpt.dir}: {kind} {stored!r} is missing from the quantized checkpoint")
                value = ckpt.read(stored)
                if tuple(value.shape) != tuple(tensor.shape):
                    raise CheckpointError(
                        f"{ckpt.dir}: {stored!r} has shape {tuple(value.shape)}, the model needs {tuple(tensor.shape)}"
                    )
                value = value.to(device=device, dtype=tensor.dtype)
                table[name] = nn.Parameter(value, requires_grad=False) if kind == "parameter" else value


# ---- writing ----------------------------------------------------------------------------------


def shard_tensors(root: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor a whole-model shard holds, by the names documented above (storage layouts)."""
    out: dict[str, torch.Tensor] = {}
    embed = getattr(root, "embed", None)
    table = embed.weight if isinstance(embed, QuantizedEmbedding) else None
    for path, module in root.named_modules():
        dot = f"{path}." if path else ""
        if isinstance(module, QuantizedDense | QuantizedExperts | QuantizedEmbedding):
            for attr, weight in module.quantized_weights().items():
                if path == "head" and weight is table:
                    continue  # tied to the packed embeddings: stored once, as them
                for storage, tensor in storage_tensors(weight).items():
                    out[f"{dot}{attr}.{storage}"] = tensor.cpu()
        if getattr(module, "packed_nbytes", 0):
            raise CheckpointError(f"{path} holds a oneDNN-packed layout; load with pack=False to write it")
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if tensor is None:
                continue
            tied = isinstance(embed, torch.Tensor) and tensor.data_ptr() == embed.data_ptr()
            if f"{dot}{name}" == "head.weight" and tied:
                continue  # tied: stored once
            out[f"{dot}{name}"] = tensor.detach().contiguous().cpu()
    return out


def _files(tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    files: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if files[-1] and size + nbytes > FILE_BYTES:
            files.append({})
            size = 0
        files[-1][name] = tensor
        size += nbytes
    return files


def write_tensor_files(
    tensors: dict[str, torch.Tensor], out: Path, on_file: Callable[[int, int], None] | None = None
) -> list[Path]:
    """``tensors`` as ``model-XXXXX-of-YYYYY.safetensors`` files of at most FILE_BYTES (one larger
    tensor gets a file alone) plus ``model.safetensors.index.json``, in ``out``."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    files = _files(tensors)
    written, weight_map = [], {}
    for i, group in enumerate(files):
        path = out / f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        save_file(group, path, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, path.name))
        written.append(path)
        if on_file is not None:
            on_file(i + 1, len(files))
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())  # transformers reads it
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return written


def save_quantized(
    root: nn.Module,
    source_dir: str | Path,
    out_dir: str | Path,
    plan: FormatPlan,
    dtype: torch.dtype,
    on_file: Callable[[int, int], None] | None = None,
) -> list[Path]:
    """Write a whole-model shard quantized by ``plan`` as a quantized checkpoint in ``out_dir``."""
    source, out = Path(source_dir), Path(out_dir)
    written = write_tensor_files(shard_tensors(root), out, on_file)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": QUANT_METHOD,
        "version": VERSION,
        "formats": plan.to_json(),
        "dtype": str(dtype).removeprefix("torch."),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    src = Checkpoint(source)
    index = {n: {"dtype": DTYPE_NAMES[src.info(n).dtype], "shape": list(src.info(n).shape)} for n in src.names()}
    (out / SOURCE_INDEX).write_text(json.dumps({"tensors": index}))
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)
    return written
