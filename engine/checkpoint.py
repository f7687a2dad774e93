"""Read tensors from a Hugging Face checkpoint directory, touching only the files that hold them.

The safetensors format is a little-endian u64 header length, a JSON header mapping each tensor
name to ``{dtype, shape, data_offsets}``, then the raw bytes. Headers are parsed here (with
every offset checked against the file size) so that corrupt or truncated files are reported
before any tensor is built, and each tensor is read with ``readinto`` into storage of its own:
nothing keeps a memory map of a whole file alive.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Protocol, TypeVar

import torch

from .errors import CheckpointError

FileT = TypeVar("FileT")

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,  # DeepSeek-V4's FP4 expert and FP8 block scales
}
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def _read_header(path: Path) -> dict[str, TensorInfo]:
    size = path.stat().st_size
    with path.open("rb") as f:
        header_len = header_length(path, f.read(8), size)
        return parse_header(path, f.read(header_len), size)


def header_length(path: Path, prefix: bytes, size: int) -> int:
    """The header length the first 8 bytes of a ``size``-byte file declare, checked against the size."""
    if len(prefix) < 8:
        raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
        raise CheckpointError(
            f"{path}: corrupt safetensors header (declares {header_len} header bytes, file has {size})"
        )
    return int(header_len)


def parse_header(path: Path, header_bytes: bytes, size: int) -> dict[str, TensorInfo]:
    """Tensor name -> location from the header JSON of a ``size``-byte file (bytes 8 onwards)."""
    try:
        header = json.loads(header_bytes)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: corrupt safetensors header JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    base = 8 + len(header_bytes)
    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        infos[name] = _tensor_info(path, name, entry, base, size)
    return infos


def _tensor_info(path: Path, name: str, entry: object, base: int, size: int) -> TensorInfo:
    try:
        dtype_name, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]  # type: ignore[index]
    except (TypeError, KeyError, ValueError) as exc:
        raise CheckpointError(f"{path}: corrupt header entry for tensor {name!r}") from exc
    if dtype_name not in DTYPES:
        raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype_name!r}")
    dtype = DTYPES[dtype_name]
    count = 1
    for dim in shape:
        count *= int(dim)
    nbytes = count * dtype.itemsize
    if end - begin != nbytes or begin < 0:
        raise CheckpointError(f"{path}: tensor {name!r} declares {end - begin} bytes, shape needs {nbytes}")
    if base + end > size:
        raise CheckpointError(
            f"{path}: truncated file: tensor {name!r} ends at byte {base + end}, file has {size} bytes"
        )
    return TensorInfo(path, dtype, tuple(int(d) for d in shape), base + begin, nbytes)


class IndexedTensors(Generic[FileT]):
    """``names()``, ``in`` and ``info(name)`` over a map of tensor name -> the file holding it;
    a subclass fills ``_file_of`` and says how a file's headers are read and where it is."""

    _file_of: dict[str, FileT]

    def _infos_in(self, file: FileT) -> Mapping[str, TensorInfo]:
        raise NotImplementedError

    def _where(self, file: FileT | None = None) -> str:
        raise NotImplementedError

    def names(self) -> list[str]:
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def info(self, name: str) -> TensorInfo:
        if name not in self._file_of:
            raise CheckpointError(f"{self._where()}: tensor {name!r} is not in the checkpoint")
        file = self._file_of[name]
        info = self._infos_in(file).get(name)
        if info is None:
            raise CheckpointError(f"{self._where(file)}: tensor {name!r} is listed in the index but absent")
        return info


class Checkpoint(IndexedTensors[Path]):
    """An index of tensor name -> location, built from the index file or the file headers.

    With ``model.safetensors.index.json`` present, only the files that hold requested tensors
    are ever opened. ``files_opened`` records which files this object has read from.
    """

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise CheckpointError(f"model directory {str(self.dir)!r} does not exist")
        self.files_opened: set[Path] = set()
        self._headers: dict[Path, dict[str, TensorInfo]] = {}
        self._file_of = self._map_names()

    def _map_names(self) -> dict[str, Path]:
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: corrupt index ({exc})") from exc
            return {name: self.dir / fname for name, fname in weight_map.items()}
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.dir}: no *.safetensors files found in the checkpoint directory")
        mapping: dict[str, Path] = {}
        for path in files:
            for name in self._header(path):
                mapping[name] = path
        return mapping

    def _header(self, path: Path) -> dict[str, TensorInfo]:
        if path not in self._headers:
            if not path.is_file():
                raise CheckpointError(f"{path}: listed in the index but missing from the directory")
            self.files_opened.add(path)
            self._headers[path] = _read_header(path)
        return self._headers[path]

    def _infos_in(self, file: Path) -> Mapping[str, TensorInfo]:
        return self._header(file)

    def _where(self, file: Path | None = None) -> str:
        return str(self.dir if file is None else file)

    def read(self, name: str) -> torch.Tensor:
        """The tensor in its stored dtype, in fresh CPU storage of its own."""
        info = self.info(name)
        buf = torch.empty(info.nbytes, dtype=torch.uint8)
        with info.file.open("rb") as f:
            f.seek(info.start)
            got = f.readinto(buf.numpy().data)
        if got != info.nbytes:
            raise CheckpointError(f"{info.file}: truncated while reading {name!r} ({got} of {info.nbytes} bytes)")
        if info.dtype == torch.bool:
            return buf.view(torch.bool).reshape(info.shape)
        return buf.view(info.dtype).reshape(info.shape)

    def nbytes(self, names: Iterable[str]) -> int:
        return sum(self.info(n).nbytes for n in names)


class TensorSource(Protocol):
    """What shard loading needs from a checkpoint: membership and reading by name."""

    def __contains__(self, name: str) -> bool: ...

    def read(self, name: str) -> torch.Tensor: ...


class TensorDict:
    """Tensors already in memory (e.g. a transformers model's state dict) as a tensor source.

    Reads return clones, so a shard never shares storage with the source.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = dict(tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def read(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise CheckpointError(f"tensor {name!r} is not in the state dict")
        return self.tensors[name].detach().clone()


class ListedTensors:
    """A tensor index of names, dtypes and shapes without data: what a directory holding only
    config.json stands for, where a model family lists the checkpoint it publishes
    (``published_tensors``), so ``inspect`` and the planners size the real model from its config."""

    def __init__(self, tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], where: Path):
        self.tensors, self.where = dict(tensors), where

    def names(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        dtype, shape = self.tensors[name]
        return TensorInfo(self.where, dtype, shape, 0, math.prod(shape) * dtype.itemsize)
