"""Export any checkpoint we load as a plain Hugging Face checkpoint: the source's own tensor
names and shapes (per-expert or fused, as the family stores them), float32 or bfloat16 values
equal to what the engine computes with (quantized weights by their exact decode), so other
engines (transformers, llama.cpp's converter) run exactly what we serve.

How names are recovered without a per-family inverse: the family builders only move, stack,
split and repeat source elements (no arithmetic), so building the model once from a *probe*
source, whose every element holds a digit of its own global index, shows where each built
parameter element came from. Two passes of base-2^16 digits (each stored as digit + 0.5, exact
in float32, so a parameter not made of source elements shows itself by its fractions) name
elements of checkpoints up to 2^32 values. The real model's parameters (dequantized) are then
scattered back to those source elements. A builder that computed a value from source elements
would break this; ``verify_export`` (the tests) rebuilds the model from the exported tensors and
compares every parameter exactly.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from .checkpoint import Checkpoint, TensorDict
from .errors import CheckpointError
from .quantized_checkpoint import TOKENIZER_FILES, QuantizedCheckpoint, open_checkpoint, write_tensor_files
from .shard import Shard
from .spec import load_spec

DIGIT_BITS = 16  # probe digits stay below 2^16: exact in float32 with a half added
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FLOAT_SOURCE = (torch.float32, torch.float16, torch.bfloat16)


def source_index(model_dir: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The source checkpoint's tensor names, dtypes and shapes (a quantized checkpoint lists them
    in source_tensors.json)."""
    ckpt = open_checkpoint(model_dir, load_spec(model_dir).raw)
    if isinstance(ckpt, QuantizedCheckpoint):
        skeleton = ckpt.skeleton
        return {name: (skeleton.read(name).dtype, tuple(skeleton.read(name).shape)) for name in skeleton.index}
    return {name: (ckpt.info(name).dtype, ckpt.info(name).shape) for name in ckpt.names()}


def offsets_of(index: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> dict[str, int]:
    """Each float source tensor's first global element index (the probe's numbering)."""
    offsets, total = {}, 0
    for name, (dtype, shape) in index.items():
        if dtype in FLOAT_SOURCE:
            offsets[name] = total
            total += math.prod(shape)
    return offsets


def probe_source(
    index: dict[str, tuple[torch.dtype, tuple[int, ...]]], offsets: dict[str, int], shift: int, ckpt: Checkpoint
) -> TensorDict:
    """Float tensors hold digit ``shift`` of their elements' global indices (+ 0.5); others as stored."""
    tensors = {}
    for name, (_, shape) in index.items():
        if name in offsets:
            ids = torch.arange(offsets[name], offsets[name] + math.prod(shape), dtype=torch.int64)
            tensors[name] = (((ids >> shift) & ((1 << DIGIT_BITS) - 1)).to(torch.float32) + 0.5).reshape(shape)
        else:
            tensors[name] = _stored(ckpt, name)
    return TensorDict(tensors)


def _stored(ckpt: Checkpoint, name: str) -> torch.Tensor:
    if name not in ckpt:
        raise CheckpointError(
            f"{ckpt.dir}: source tensor {name!r} is not a float tensor and is not stored; export needs "
            "float (bf16, fp16, f32) source tensors or the tensor itself"
        )
    return ckpt.read(name)


def element_sources(model_dir: Path, index: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """For every parameter path of the built whole model made of source elements: int64 global
    source indices of its elements, in its shape."""
    spec, ckpt = load_spec(model_dir), Checkpoint(model_dir)
    offsets = offsets_of(index)
    total = sum(math.prod(index[n][1]) for n in offsets)
    ids: dict[str, torch.Tensor] = {}
    valid: dict[str, bool] = {}
    for shift in range(0, max(total - 1, 1).bit_length(), DIGIT_BITS):
        probe = Shard.from_checkpoint(spec, probe_source(index, offsets, shift, ckpt), pack=False)
        for path, value in _float_parameters(probe):
            digit = value.to(torch.float64) - 0.5
            ok = bool((digit == digit.floor()).all()) and bool(((digit >= 0) & (digit < 1 << DIGIT_BITS)).all())
            valid[path] = valid.get(path, True) and ok
            if ok:
                ids[path] = ids.get(path, torch.zeros(value.shape, dtype=torch.int64)) | (
                    digit.to(torch.int64) << shift
                )
    return {path: ids[path] for path, ok in valid.items() if ok and bool((ids[path] < total).all())}


def _float_parameters(root: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for path, param in root.named_parameters():
        if param.is_floating_point() and param.device.type != "meta":
            yield path, param.detach()


def real_value(root: nn.Module, path: str) -> torch.Tensor:
    """The parameter at ``path`` of the loaded model as float32: a quantized weight's exact decode."""
    module_path, _, name = path.rpartition(".")
    module = root.get_submodule(module_path)
    value = getattr(module, name)
    if isinstance(value, nn.Module):  # packed embeddings: the probe's plain parameter is a module here
        module, name = value, "weight"
    quantized = getattr(module, "quantized_weights", None)
    if quantized is not None and name in quantized():
        decoded: torch.Tensor = quantized()[name].dequantize()
        return decoded.to(torch.float32)
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"export cannot read {path!r} of the loaded model ({type(value).__name__})")
    return value.detach().to(torch.float32)


def exported_tensors(model_dir: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every source tensor, by its source name, with the values the engine computes with."""
    index = source_index(model_dir)
    offsets = offsets_of(index)
    sources = element_sources(model_dir, index)
    model = Shard.load(model_dir, dtype=torch.float32, pack=False)
    total = sum(math.prod(index[n][1]) for n in offsets)
    flat, covered = torch.zeros(total, dtype=torch.float32), torch.zeros(total, dtype=torch.bool)
    for path, ids in sources.items():
        value = real_value(model, path)
        if tuple(value.shape) != tuple(ids.shape):
            raise CheckpointError(f"export: {path!r} is {tuple(value.shape)} loaded but {tuple(ids.shape)} built")
        flat[ids.reshape(-1)] = value.reshape(-1)
        covered[ids.reshape(-1)] = True
    return _by_name(model_dir, index, offsets, flat, covered, dtype)


def _by_name(
    model_dir: Path,
    index: dict[str, tuple[torch.dtype, tuple[int, ...]]],
    offsets: dict[str, int],
    flat: torch.Tensor,
    covered: torch.Tensor,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    ckpt = Checkpoint(model_dir)
    out: dict[str, torch.Tensor] = {}
    for name, (_, shape) in index.items():
        if name not in offsets:
            out[name] = _stored(ckpt, name)
            continue
        start, count = offsets[name], math.prod(shape)
        if bool(covered[start : start + count].all()):
            out[name] = flat[start : start + count].reshape(shape).to(dtype)
        elif name in ckpt and ckpt.info(name).dtype in FLOAT_SOURCE:  # a tensor the engine does not build (MTP)
            out[name] = ckpt.read(name).to(dtype)
        else:
            raise CheckpointError(
                f"{model_dir}: source tensor {name!r} is neither built by the engine nor stored plain; it cannot be exported"
            )
    return out


def export_checkpoint(
    model_dir: Path,
    out_dir: Path,
    dtype: torch.dtype = torch.float32,
    on_file: Callable[[int, int], None] | None = None,
) -> list[Path]:
    """Write ``model_dir`` (plain or quantized) as a plain Hugging Face checkpoint in ``out_dir``."""
    written = write_tensor_files(exported_tensors(model_dir, dtype), out_dir, on_file)
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    config["dtype"] = str(dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, out_dir / name)
    return written


def verify_export(model_dir: Path, out_dir: Path) -> None:
    """Raise unless the exported checkpoint builds a model whose every parameter equals the
    loaded source model's (dequantized) parameter exactly."""
    source = Shard.load(model_dir, dtype=torch.float32, pack=False)
    exported = Shard.load(out_dir, dtype=torch.float32, pack=False)
    for path, value in _float_parameters(exported):
        expected = real_value(source, path)
        if not torch.equal(value.to(torch.float32), expected):
            raise CheckpointError(f"export of {model_dir}: {path!r} differs from the loaded model")
