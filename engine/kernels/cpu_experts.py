"""The CPU share of an expert store's step as one compiled call over packed banks.

Why a kernel of our own: torch's CPU int4 kernel reads only its own layout (a second copy of every
offloaded expert in host memory beside the pinned mirror the device copies from), it computes one
expert per call (a step's CPU share was a dozen calls, each a dispatch, a thread hand-off and a
host-side weighted sum: 2.5-3 GB/s in a step against 6-12 GB/s in a loop), and MXFP4 has no CPU
kernel in torch at all (the decode-in-tiles path reads 0.26 GB/s). No well-kept library takes
these banks as they are: llama.cpp's ggml and KTransformers' kernels read their own block layouts
(repacking would again double host memory) and are not importable as a function over a torch
tensor. ``cpu_experts.c`` (about 400 lines: AVX-512, AVX2/FMA/F16C and portable C paths) reads the
device kernels' layout in the pinned mirror directly: one copy of each expert in host memory.

What one call computes, for a layer: for each token row t, the sum over its (token, expert) pairs
whose expert is in the given set of ``w * down_e(glu(gate_up_e(x_t)))``, in float32, with the
bank's biases. Codes are decoded exactly (int4 ``(q - z) * s`` with fp16 s, MXFP4 E2M1 times
2^(e - 127)); products and sums are float32 in the kernel's order, so results agree with the
reference decode within float32 rounding, not bit for bit.

Layouts taken (a bank of E experts; N rows, K inputs; G = K / 32):
- codes uint8 [E, N, K/2]: 4-bit codes, either ours (byte j of a group: inputs 2j low, 2j + 1
  high) or nibble-major (:func:`~engine.formats.base.to_nibble_major`; the CUDA kernels' order);
- int4: scales fp16 [E, N, G] and zero points uint8 [E, N, G] (one per byte; ``int4_sym``: none,
  z = 8); MXFP4: E8M0 scale bytes uint8 [E, N, G].

Threads: the library keeps a pool of persistent threads (spinning ~5 ms for the next call, longer
than the gap between a decode step's layers, then sleeping); a call uses ``threads`` of them including the caller, and releases the interpreter lock
while it runs. The library is compiled on first use with the system C compiler (``$CC``, else
``cc``) for this machine (``-march=native``) into the user's cache; without a compiler
:func:`available` is False (with the reason in :func:`unavailable_reason`) and callers use torch.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..paths import user_cache_dir
from .grouped_moe import ACT_CLAMPED_SWIGLU, ACT_SILU

SOURCE = Path(__file__).with_name("cpu_experts.c")
CACHE_ENV = "MF_KERNEL_CACHE_DIR"
FORMATS = {"int4": 0, "int4_sym": 1, "mxfp4": 2}
GROUP = 32


class _Bank(ctypes.Structure):
    _fields_ = [
        ("codes", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("zeros", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("rows", ctypes.c_int64),
        ("cols", ctypes.c_int64),
    ]


class _Args(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_int32) for name in ("format", "act", "nibble_major", "threads")),
        ("alpha", ctypes.c_float),
        ("limit", ctypes.c_float),
        ("gate_up", _Bank),
        ("down", _Bank),
        *((name, ctypes.c_int32) for name in (
            "experts", "tokens", "top_k", "chosen_count", "x_dtype", "weight_dtype", "out_dtype",
        )),
        *((name, ctypes.c_void_p) for name in ("x", "index", "weight", "chosen", "out")),
        ("pairs", ctypes.c_int32),
        ("used", ctypes.c_int32),
        *((name, ctypes.c_void_p) for name in (
            "expert", "pair_start", "pair_row", "pair_weight", "row_start", "row_pair", "xp", "act_buf", "y",
        )),
    ]  # fmt: skip


DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the kernel's DT_*


def cache_dir() -> Path:
    """Where compiled kernels live: $MF_KERNEL_CACHE_DIR, else ~/.cache/modelfleet/kernels."""
    return user_cache_dir("kernels", CACHE_ENV)


def _cpu_signature() -> str:
    """What -march=native depends on: the machine and its CPU's feature flags."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()} {flags}"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")


NATIVE = ("-march=native",)
PORTABLE = ("-march=x86-64",) if platform.machine() == "x86_64" else ()  # the plain C path (tests)


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    """(the library built for this machine, "") or (None, why not)."""
    return build(NATIVE)


def build(target_flags: tuple[str, ...]) -> tuple[ctypes.CDLL | None, str]:
    """Compile (once per source, flags and CPU; cached) and load the kernel: (library, "") or (None, why not)."""
    if platform.system() != "Linux":
        return None, f"the CPU expert kernel is built for Linux only (this is {platform.system()})"
    compiler = _compiler()
    if compiler is None:
        return None, "no C compiler (set $CC or install gcc) to build the CPU expert kernel"
    source = SOURCE.read_bytes()
    flags = ["-O3", *target_flags, "-std=gnu11", "-fPIC", "-shared", "-pthread"]
    key = hashlib.sha256(source + " ".join([compiler, *flags, _cpu_signature()]).encode()).hexdigest()[:16]
    target = cache_dir() / f"cpu_experts-{key}.so"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
                built = Path(scratch) / target.name
                subprocess.run(
                    [compiler, *flags, "-o", str(built), str(SOURCE), "-lm"], check=True, capture_output=True
                )
                os.replace(built, target)  # atomic: processes building at once each publish a whole file
        except (OSError, subprocess.CalledProcessError) as error:
            detail = getattr(error, "stderr", b"") or b""
            return None, f"building the CPU expert kernel failed: {error} {detail.decode(errors='replace')[-400:]}"
    library = ctypes.CDLL(str(target))
    library.mf_moe.argtypes = [ctypes.POINTER(_Args)]
    library.mf_moe.restype = ctypes.c_int
    library.mf_vectorized.restype = ctypes.c_int
    library.mf_set_spin.argtypes = [ctypes.c_long]
    return library, ""


def available() -> bool:
    return _library()[0] is not None


def unavailable_reason() -> str:
    return _library()[1]


def instruction_set(library: ctypes.CDLL | None = None) -> str:
    """Which path a build (default: this machine's) runs: avx512, avx2 or portable C."""
    library = library or _library()[0]
    if library is None:
        return "none"
    return {2: "avx512", 1: "avx2"}.get(int(library.mf_vectorized()), "c")


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@dataclass(frozen=True)
class PackedProjection:
    """One projection of a bank as the kernel reads it (see the module docstring for layouts)."""

    codes: torch.Tensor  # uint8 [E, N, K/2]
    scales: torch.Tensor  # fp16 [E, N, G] (int4) or uint8 [E, N, G] (MXFP4)
    zeros: torch.Tensor | None  # uint8 [E, N, G] (int4) or None
    bias: torch.Tensor | None  # float32 [E, N] or None

    def check(self, fmt: str) -> None:
        e, n, half = self.codes.shape
        groups = half * 2 // GROUP
        expected = torch.float16 if fmt != "mxfp4" else torch.uint8
        tensors = [self.codes, self.scales] + [t for t in (self.zeros, self.bias) if t is not None]
        if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
            raise ValueError("the CPU expert kernel reads contiguous host tensors")
        if (
            self.codes.dtype != torch.uint8
            or self.scales.dtype != expected
            or tuple(self.scales.shape) != (e, n, groups)
        ):
            raise ValueError(f"{fmt} bank: codes uint8 [E, N, K/2] and scales {expected} [E, N, K/32] expected")
        if (fmt == "int4") != (self.zeros is not None):
            raise ValueError("int4 banks take zero points (one byte per group); int4_sym and mxfp4 none")
        if self.zeros is not None and (self.zeros.dtype != torch.uint8 or self.zeros.shape != self.scales.shape):
            raise ValueError("zero points: uint8 [E, N, K/32]")
        if self.bias is not None and (self.bias.dtype != torch.float32 or tuple(self.bias.shape) != (e, n)):
            raise ValueError("bias: float32 [E, N]")

    def struct(self) -> _Bank:
        return _Bank(
            _pointer(self.codes), _pointer(self.scales), _pointer(self.zeros), _pointer(self.bias),
            self.codes.shape[1], self.codes.shape[2] * 2,
        )  # fmt: skip


class CpuExperts:
    """A packed bank's experts computed on the CPU by the compiled kernel (one call per step)."""

    def __init__(
        self,
        fmt: str,
        gate_up: PackedProjection,
        down: PackedProjection,
        nibble_major: bool,
        activation: tuple[int, float, float] = (ACT_SILU, 1.0, 0.0),
        threads: int = 1,
        library: ctypes.CDLL | None = None,
    ):
        if fmt not in FORMATS:
            raise ValueError(f"the CPU expert kernel takes {sorted(FORMATS)}, not {fmt!r}")
        if activation[0] not in (ACT_SILU, ACT_CLAMPED_SWIGLU):
            raise ValueError(
                f"the CPU expert kernel's GLUs are SiLU and GPT-OSS's (kinds 1, 2), not kind {activation[0]}"
            )
        gate_up.check(fmt)
        down.check(fmt)
        e, two_inner, hidden_half = gate_up.codes.shape
        if down.codes.shape != (e, hidden_half * 2, two_inner // 4) or two_inner % (2 * GROUP):
            raise ValueError(f"gate_up {tuple(gate_up.codes.shape)} and down {tuple(down.codes.shape)} codes disagree")
        if library is None:
            library, why = _library()
            if library is None:
                raise RuntimeError(why)
        self._library = library
        self.format, self.gate_up, self.down, self.nibble_major = fmt, gate_up, down, nibble_major
        self.activation, self.threads = activation, max(1, threads)
        self.num_experts, self.hidden, self.inner = e, hidden_half * 2, two_inner // 2
        kind, alpha, limit = activation
        self._args = _Args(
            FORMATS[fmt], kind, int(nibble_major), self.threads, alpha, limit, gate_up.struct(), down.struct()
        )
        self._args.experts = e
        self.expert_nbytes = sum(
            t[0].numel() * t.element_size()
            for p in (gate_up, down)
            for t in (p.codes, p.scales, p.zeros)
            if t is not None
        )

    def __call__(
        self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, experts: set[int], pin_memory: bool = False
    ) -> torch.Tensor:
        """x [T, H], index/weight [T, k] on the host -> [T, H] in x's dtype (float32 for fp16):
        each row's weighted sum over its pairs whose expert is in ``experts`` (rows with none: 0).
        ``threads`` of the pool compute it (the caller included), the interpreter lock released;
        the pairs are grouped in the kernel, so a call costs one dispatch however many experts.
        ``pin_memory``: the result in pinned memory (for an asynchronous copy to a device)."""
        tokens, k = index.shape
        if x.shape != (tokens, self.hidden) or weight.shape != index.shape:
            raise ValueError(
                f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match index {tuple(index.shape)} "
                f"and hidden {self.hidden}"
            )
        x = x.contiguous() if x.dtype in DTYPES else x.to(torch.float32).contiguous()
        weight = weight.contiguous() if weight.dtype in DTYPES else weight.to(torch.float32).contiguous()
        index = index.to(torch.int64).contiguous()
        out_dtype = x.dtype if x.dtype != torch.float16 else torch.float32
        out = torch.empty(tokens, self.hidden, dtype=out_dtype, pin_memory=pin_memory)
        chosen = (ctypes.c_int32 * max(len(experts), 1))(*experts)
        args = self._args
        args.threads, args.tokens, args.top_k, args.chosen_count = self.threads, tokens, k, len(experts)
        args.x_dtype, args.weight_dtype, args.out_dtype = DTYPES[x.dtype], DTYPES[weight.dtype], DTYPES[out.dtype]
        args.x, args.index, args.weight = x.data_ptr(), index.data_ptr(), weight.data_ptr()
        args.chosen, args.out = ctypes.addressof(chosen), out.data_ptr()
        status = self._library.mf_moe(ctypes.byref(args))
        if status != 0:
            raise ValueError(
                f"the CPU expert kernel refused a {self.format} bank of shape {tuple(self.gate_up.codes.shape)}"
            )
        return out
