"""The expert store: an MoE layer's experts in host banks, a fixed-slot device cache of hot experts,
and per-step hybrid miss service (seed 001, "Where the 28% split comes from").

:class:`ExpertStore` takes the place of a :class:`~engine.layers.SparseMoE`'s ``experts`` module
(plain :class:`~engine.layers.Experts` or :class:`~engine.quantize.QuantizedExperts`) and is
called exactly as it: ``store(x, index, weight)``. Each step:

1. the experts the step routes to are looked up in the slot map (:class:`SlotMap`): hits run on the
   device from their slots;
2. the misses are split by bytes (:func:`split_misses`): a fraction ``q`` is fetched into slots
   (evicting by :func:`choose_victim`) and runs on the device, the rest runs in place on the CPU
   from the packed host bank, *concurrently* with the device path (on CUDA, 4-bit banks: one call
   of the compiled kernel over the pinned mirror, :mod:`.kernels.cpu_experts`; otherwise torch's
   kernels on a worker thread);
3. every used expert's rows are computed exactly once, over the same rows as the all-resident
   path, and :func:`~engine.layers.forward_grouped` sums the pairs in its own order, so where the
   same kernel runs on both sides the result is bit-identical to the all-resident bank.

Banks stay in their format (int4, mxfp4 codes): a slot holds one expert sliced from the bank with
storage of its own (:func:`expert_slice`), never a full-precision copy. The device side is a
seam: :class:`SlotStorage` copies an expert into a slot and runs a slot; here the copy is a
slice moved to the store's device (on a CPU-only machine the "device" is the same CPU, which
checks the mechanics, not the bandwidths). The CUDA version (pinned banks, copies on a side
stream into a stacked slot bank read by the gathered kernels) implements the same two methods.

Decisions are pure functions on plain data (eviction, the split, q*, the predicted step time);
the module holds the mechanism. Applying a placement to a shard is :mod:`.expert_offload`.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from .errors import InputError
from .formats.base import unpack_nibbles
from .kernels import cpu_experts
from .layers import Experts, SparseMoE, forward_grouped, glu_kind
from .quantize import QuantizedExperts

Bank = Experts | QuantizedExperts


class EvictionPolicy(enum.StrEnum):
    LRU = "lru"  # the slot used longest ago
    FREQUENCY = "frequency"  # the expert routed to least often so far (ties: the one used longest ago)


# ---- decisions (pure) -----------------------------------------------------------------------


@dataclass
class SlotState:
    expert: int | None = None
    last_used: int = -1  # the step that last read this slot


def choose_victim(
    policy: EvictionPolicy, slots: Sequence[SlotState], frequency: dict[int, int], pinned: set[int]
) -> int | None:
    """The slot to (re)fill next: an empty one first, else by ``policy`` among slots whose expert
    is not ``pinned`` (used by the step being computed); None when every slot is pinned."""
    for i, slot in enumerate(slots):
        if slot.expert is None:
            return i
    candidates = [i for i, slot in enumerate(slots) if slot.expert not in pinned]
    if not candidates:
        return None
    if policy is EvictionPolicy.LRU:
        return min(candidates, key=lambda i: (slots[i].last_used, i))
    return min(candidates, key=lambda i: (frequency.get(slots[i].expert or 0, 0), slots[i].last_used, i))


def split_misses(misses: Sequence[tuple[int, int]], q: float, capacity: int) -> tuple[list[int], list[int]]:
    """Split a step's misses ``(expert, bytes)`` (in the order to prefer for fetching) into
    (fetched, computed on the CPU) so the fetched bytes come nearest ``q`` of the total, at most
    ``capacity`` fetched. q = 0 computes every miss on the CPU; q = 1 fetches every one that fits."""
    if not 0.0 <= q <= 1.0:
        raise InputError(f"the fetched share q must be in [0, 1], got {q}")
    target = q * sum(nbytes for _, nbytes in misses)
    fetched: list[int] = []
    on_cpu: list[int] = []
    taken = 0
    for expert, nbytes in misses:
        closer = abs(taken + nbytes - target) < abs(taken - target) or (q == 1.0)
        if closer and len(fetched) < capacity:
            fetched.append(expert)
            taken += nbytes
        else:
            on_cpu.append(expert)
    return fetched, on_cpu


def q_star(beta_g: float, beta_c: float) -> float:
    """The fetched share that finishes both paths together: q* = beta_g / (beta_g + beta_c)
    (bytes per second: host-to-device copy vs CPU compute over packed banks, under contention)."""
    if beta_g < 0 or beta_c < 0 or beta_g + beta_c <= 0:
        raise InputError(f"bandwidths must be >= 0 and not both 0, got beta_g={beta_g}, beta_c={beta_c}")
    return beta_g / (beta_g + beta_c)


def predicted_step_seconds(miss_bytes: int, q: float, beta_g: float, beta_c: float) -> float:
    """Miss service time of one step: max(T_g, T_c), T_g = q B / beta_g, T_c = (1 - q) B / beta_c
    (a path given no bytes costs nothing even at bandwidth 0)."""
    t_g = q * miss_bytes / beta_g if q > 0 else 0.0
    t_c = (1 - q) * miss_bytes / beta_c if q < 1 else 0.0
    return max(t_g, t_c)


# ---- the slot map ---------------------------------------------------------------------------


class SlotMap:
    """Which expert each of ``num_slots`` device slots holds, and the counters of lookups."""

    def __init__(self, num_slots: int, policy: EvictionPolicy):
        self.slots = [SlotState() for _ in range(num_slots)]
        self.policy = policy
        self.slot_of: dict[int, int] = {}
        self.frequency: dict[int, int] = {}
        self.step = 0
        self.hits = self.misses = 0
        self.prefetched: set[int] = set()  # admitted ahead of the next step, not yet looked up
        self.prefetch_hits = 0  # prefetched experts that the next step used

    def lookup(self, experts: Sequence[int]) -> tuple[list[int], list[int]]:
        """Start a step that routes to ``experts``: (hits, misses), counted; hits are marked used
        (a hit admitted ahead of this step is a prefetch hit)."""
        self.step += 1
        self.prefetch_hits += sum(1 for e in experts if e in self.prefetched and e in self.slot_of)
        self.prefetched.clear()
        hits, misses = [], []
        for e in experts:
            self.frequency[e] = self.frequency.get(e, 0) + 1
            slot = self.slot_of.get(e)
            if slot is None:
                misses.append(e)
            else:
                hits.append(e)
                self.slots[slot].last_used = self.step
        self.hits += len(hits)
        self.misses += len(misses)
        return hits, misses

    def free_capacity(self, pinned: set[int]) -> int:
        """How many misses this step can fetch: slots not holding a pinned expert."""
        return sum(1 for s in self.slots if s.expert is None or s.expert not in pinned)

    def admit(self, expert: int, pinned: set[int]) -> int:
        """Give ``expert`` a slot (evicting by policy); the caller copies its bytes in."""
        slot = choose_victim(self.policy, self.slots, self.frequency, pinned)
        if slot is None:
            raise RuntimeError(f"no slot to admit expert {expert}: all {len(self.slots)} are in use this step")
        old = self.slots[slot].expert
        if old is not None:
            del self.slot_of[old]
        self.slots[slot] = SlotState(expert, self.step)
        self.slot_of[expert] = slot
        return slot

    def admit_ahead(self, experts: Sequence[int]) -> list[tuple[int, int]]:
        """Slots for ``experts`` (most wanted first) ahead of the step that will use them: (slot,
        expert) for each one not held, evicting by policy but never one of ``experts``; stops when
        every slot holds one of them."""
        wanted, loads = set(experts), []
        for e in experts:
            if e in self.slot_of:
                continue
            if choose_victim(self.policy, self.slots, self.frequency, wanted) is None:
                break
            loads.append((self.admit(e, wanted), e))
            self.prefetched.add(e)
        return loads

    def held(self) -> list[int]:
        return sorted(self.slot_of)


# ---- banks and slots ------------------------------------------------------------------------


def expert_bytes(bank: Bank) -> int:
    """Bytes of one expert as the bank holds it (packed formats stay packed; biases included)."""
    if isinstance(bank, QuantizedExperts):
        total = bank.gate_up.nbytes + bank.down.nbytes
    elif bank.packed is not None:
        total = bank.packed_nbytes
    else:
        total = (bank.gate_up.numel() + bank.down.numel()) * bank.gate_up.element_size()
    for bias in (bank.gate_up_bias, bank.down_bias):
        if bias is not None:
            total += bias.numel() * bias.element_size()
    return total // bank.num_experts


def _bias_rows(bias: torch.Tensor | None, e: int, device: torch.device) -> torch.Tensor | None:
    return None if bias is None else bias.data[e : e + 1].to(device, copy=True)


def expert_slice(bank: Bank, e: int, device: torch.device) -> Bank:
    """Expert ``e`` of ``bank`` as a one-expert bank of the same kind with storage of its own on
    ``device`` (quantized codes stay packed; a CPU bank's kernel layouts come along)."""
    gu_bias, d_bias = _bias_rows(bank.gate_up_bias, e, device), _bias_rows(bank.down_bias, e, device)
    if isinstance(bank, QuantizedExperts):
        gate_up, down = bank.gate_up.slice(0, e, e + 1).to(device), bank.down.slice(0, e, e + 1).to(device)
        return QuantizedExperts(gate_up, down, gu_bias, d_bias, bank.activation)
    if bank.packed is not None:  # oneDNN layout (CPU): the plain tensors are empty
        one = Experts(bank.gate_up.data, bank.down.data, gu_bias, d_bias, bank.activation)
        if device.type != "cpu":
            raise InputError("a oneDNN-packed (CPU) expert bank cannot fill device slots; load it unpacked")
        one.packed = [(bank.packed[e][0].clone(), bank.packed[e][1].clone())]
        one.packed_nbytes = bank.packed_nbytes // bank.num_experts
        return one
    plain_gate_up = bank.gate_up.data[e : e + 1].to(device, copy=True)
    return Experts(plain_gate_up, bank.down.data[e : e + 1].to(device, copy=True), gu_bias, d_bias, bank.activation)


class SlotStorage:
    """The device side of the store: ``load(slot, e)`` copies expert e of the host bank into a
    slot, ``run(slot, rows)`` applies it. This one holds a one-expert bank per slot."""

    def __init__(self, host: Bank, num_slots: int, device: torch.device):
        self.host, self.device = host, device
        self.banks: list[Bank | None] = [None] * num_slots

    def load(self, slot: int, e: int) -> None:
        self.banks[slot] = expert_slice(self.host, e, self.device)

    def run(self, slot: int, rows: torch.Tensor) -> torch.Tensor:
        bank = self.banks[slot]
        assert bank is not None, f"slot {slot} is empty"
        return bank.expert(0, rows)

    @property
    def nbytes(self) -> int:
        return sum(expert_bytes(b) for b in self.banks if b is not None)


class DeviceSlotBank:
    """The CUDA side of the store: a stacked bank of ``num_slots`` experts on the device, of the
    host bank's kind and in the device kernels' layout (int4/mxfp4 stay packed, nibble-major),
    filled from a mirror of the whole bank in pinned host memory by copies on a side stream. The
    bank's own forward (the one-row gathered/fused kernels, or the grouped kernels) runs a step's
    pairs with expert ids remapped to slots, so the kernels are those of the resident bank.

    ``bank`` may sit on the device (a shard loaded there) or on the CPU; the device layout is
    built a chunk of experts at a time on the device, so at most ``chunk`` experts are there at
    once besides the slots. ``cpu_bank()`` is the bank torch's CPU kernels read (for a plain bank
    the pinned mirror itself: one copy in host memory); with ``cpu_layout`` False none is built
    (the compiled CPU kernel reads the mirror itself, :func:`compiled_cpu_share`)."""

    def __init__(
        self,
        bank: Bank,
        num_slots: int,
        device: torch.device,
        dtype: torch.dtype,
        chunk: int = 8,
        cpu_layout: bool = True,
    ):
        if isinstance(bank, Experts) and bank.packed is not None:
            raise InputError("a oneDNN-packed (CPU) expert bank cannot fill device slots; load it unpacked")
        self.device, self.dtype, self.num_slots = device, dtype, num_slots
        self.stream = torch.cuda.Stream(device)
        self.event = torch.cuda.Event()  # the side stream's last copies
        self.read = torch.cuda.Event()  # the last slot kernel queued (what a prefetch must not overwrite early)
        self._ahead = False  # copies queued ahead of the next run, which waits for them
        num_experts = bank.num_experts
        probe = torch.zeros(1, _in_features(bank), dtype=dtype, device=device)
        self.slot_bank = _device_part(bank, 0, max(num_slots, 1), device, probe)
        self._slot_tensors = _bank_tensors(self.slot_bank)
        # the pinned mirror: every expert in the slot bank's layout, filled a chunk at a time
        self._mirror = {
            name: torch.empty((num_experts, *t.shape[1:]), dtype=t.dtype, pin_memory=True)
            for name, t in self._slot_tensors.items()
        }
        for start in range(0, num_experts, chunk):
            end = min(start + chunk, num_experts)
            part = _bank_tensors(_device_part(bank, start, end, device, probe))
            for name, t in part.items():
                self._mirror[name][start:end].copy_(t)
        torch.cuda.synchronize(device)
        self.expert_nbytes = sum(t[0].numel() * t.element_size() for t in self._mirror.values())
        self._cpu_bank = _cpu_bank(bank, self._mirror, dtype) if cpu_layout else None
        # each slot's and each expert's tensors as views made once: a step's copies are one call
        names = list(self._slot_tensors)
        self._slot_views = [[self._slot_tensors[n][s] for n in names] for s in range(max(num_slots, 1))]
        self._expert_views = [[self._mirror[n][e] for n in names] for e in range(num_experts)]

    def cpu_bank(self) -> Bank | None:
        return self._cpu_bank

    @property
    def mirror(self) -> dict[str, torch.Tensor]:
        """The pinned host copy of every expert, by tensor name (:func:`_bank_tensors`'s names)."""
        return self._mirror

    def fetch(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy expert e into slot s for each (s, e) on the side stream; the current stream waits
        for them (an event) before whatever it launches next reads the slots."""
        if not pairs:
            return
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)  # a refilled slot may still be read by work queued before
        self._copy(pairs)
        main.wait_event(self.event)

    def fetch_ahead(self, pairs: Sequence[tuple[int, int]], after: torch.cuda.Event | None = None) -> None:
        """Copy as :meth:`fetch` does, for a step still to come: the copies wait only for the last
        slot kernel (and ``after``: another bank's copies that go first), not for the current
        stream's other work, which goes on beside them; the next :meth:`run` waits for them."""
        if not pairs:
            return
        self.stream.wait_event(self.read)
        if after is not None:
            self.stream.wait_event(after)
        self._copy(pairs)
        self._ahead = True

    def _copy(self, pairs: Sequence[tuple[int, int]]) -> None:
        with torch.cuda.stream(self.stream):
            dst = [t for slot, _ in pairs for t in self._slot_views[slot]]
            src = [t for _, e in pairs for t in self._expert_views[e]]
            torch._foreach_copy_(dst, src, non_blocking=True)  # one call (and lock release) for all
            self.event.record(self.stream)

    def run(self, x: torch.Tensor, slot_index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The resident bank's forward over the slots: slot_index [T, k] (int64 on the device)."""
        main = torch.cuda.current_stream(self.device)
        if self._ahead:
            main.wait_event(self.event)
            self._ahead = False
        out: torch.Tensor = self.slot_bank(x, slot_index, weight)
        self.read.record(main)
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._slot_tensors.values())

    @property
    def host_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._mirror.values())


def _in_features(bank: Bank) -> int:
    return bank.gate_up.in_features if isinstance(bank, QuantizedExperts) else _plain_in_features(bank)


def _device_part(bank: Bank, start: int, end: int, device: torch.device, probe: torch.Tensor) -> Bank:
    """Experts [start, end) of ``bank`` as a bank on ``device`` in its kernels' layout for
    activations like ``probe`` (storage of its own)."""

    def bias(b: torch.Tensor | None) -> torch.Tensor | None:
        return None if b is None else b.data[start:end].to(device, copy=True)

    gu_bias, d_bias = bias(bank.gate_up_bias), bias(bank.down_bias)
    if isinstance(bank, QuantizedExperts):
        gate_up = bank.gate_up.slice(0, start, end).to(device)
        down = bank.down.slice(0, start, end).to(device)
        part = QuantizedExperts(gate_up, down, gu_bias, d_bias, bank.activation)
        gate_up.prepare_for(probe)
        down.prepare_for(probe.new_zeros(1, down.in_features))
        return part
    gate_up_t = bank.gate_up.data[start:end].to(device, copy=True)
    return Experts(gate_up_t, bank.down.data[start:end].to(device, copy=True), gu_bias, d_bias, bank.activation)


def _bank_tensors(bank: Bank) -> dict[str, torch.Tensor]:
    """Every tensor of a bank that holds per-expert data (leading dimension: experts), by name."""
    if isinstance(bank, QuantizedExperts):
        held = {f"gate_up.{k}": t for k, t in bank.gate_up.tensors().items()}
        held.update({f"down.{k}": t for k, t in bank.down.tensors().items()})
    else:
        held = {"gate_up": bank.gate_up.data, "down": bank.down.data}
    for name, b in (("gate_up_bias", bank.gate_up_bias), ("down_bias", bank.down_bias)):
        if b is not None:
            held[name] = b.data
    return held


def compiled_kernel_takes(bank: Bank) -> bool:
    """Whether the compiled CPU kernel computes ``bank``'s experts: a 4-bit bank (int4, int4_sym,
    mxfp4) with a GLU it has, on a machine where the kernel builds."""
    return (
        isinstance(bank, QuantizedExperts)
        and bank.format in cpu_experts.FORMATS
        and glu_kind(bank.activation) is not None
        and cpu_experts.available()
    )


def compiled_cpu_share(tensors: dict[str, torch.Tensor], bank: Bank, threads: int) -> cpu_experts.CpuExperts | None:
    """The compiled CPU kernel over ``tensors`` (``bank``'s per-expert tensors on the host, named as
    :func:`_bank_tensors` names them: the pinned mirror's), or None where it does not take them
    (another format or GLU, no compiler, or the codes only in torch's CPU layout)."""
    if not compiled_kernel_takes(bank):
        return None
    assert isinstance(bank, QuantizedExperts)
    act = glu_kind(bank.activation)
    assert act is not None
    names = ("major_blocks", "blocks") if bank.format == "mxfp4" else ("major_codes", "codes")
    projections, majors = [], set()
    for part in ("gate_up", "down"):
        key = next((name for name in names if f"{part}.{name}" in tensors), None)
        if key is None:
            return None
        codes, scales = tensors[f"{part}.{key}"], tensors[f"{part}.scales"]
        codes = codes.reshape(*codes.shape[:2], -1)
        zeros = None
        if bank.format == "int4":
            zeros = tensors.get(f"{part}.zero_bytes")
            if zeros is None:
                zeros = unpack_nibbles(tensors[f"{part}.zeros"])[..., : scales.shape[-1]].contiguous()
        bias = tensors.get(f"{part}_bias")
        bias32 = None if bias is None else bias.to(torch.float32).contiguous()
        projections.append(cpu_experts.PackedProjection(codes, scales, zeros, bias32))
        majors.add(key.startswith("major"))
    if len(majors) != 1:
        return None
    return cpu_experts.CpuExperts(bank.format, projections[0], projections[1], majors.pop(), act, threads)


def _cpu_bank(bank: Bank, mirror: dict[str, torch.Tensor] | None, dtype: torch.dtype) -> Bank:
    """The bank the CPU workers compute from: a plain bank reads the pinned mirror in place (or
    its own copy in host memory without one); a quantized one is held in its CPU kernels' layout
    (packed: the same bytes in another order)."""
    if mirror is None:
        mirror = {
            name: t.to("cpu") for name, t in _bank_tensors(bank).items() if "bias" in name or isinstance(bank, Experts)
        }
    gu_bias, d_bias = mirror.get("gate_up_bias"), mirror.get("down_bias")
    if isinstance(bank, Experts):
        return Experts(mirror["gate_up"], mirror["down"], gu_bias, d_bias, bank.activation)
    cpu = QuantizedExperts(bank.gate_up.to("cpu"), bank.down.to("cpu"), gu_bias, d_bias, bank.activation)
    row_dtype = dtype if dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
    cpu.gate_up.prepare_for(torch.zeros(1, cpu.gate_up.in_features, dtype=row_dtype))
    cpu.down.prepare_for(torch.zeros(1, cpu.down.in_features, dtype=row_dtype))
    return cpu


def bank_to(bank: Bank, device: torch.device) -> None:
    """Move a routed-expert bank's storage to ``device`` in place (quantized codes stay packed)."""
    if isinstance(bank, QuantizedExperts):
        bank.gate_up, bank.down = bank.gate_up.to(device), bank.down.to(device)
    else:
        bank.gate_up = nn.Parameter(bank.gate_up.data.to(device), requires_grad=False)
        bank.down = nn.Parameter(bank.down.data.to(device), requires_grad=False)
    for name in ("gate_up_bias", "down_bias"):
        bias = getattr(bank, name)
        if bias is not None:
            setattr(bank, name, nn.Parameter(bias.data.to(device), requires_grad=False))


def banks_to(root: nn.Module, device: torch.device) -> None:
    """:func:`bank_to` every routed-expert bank of ``root``'s sparse MoE blocks."""
    for moe in (m for m in root.modules() if isinstance(m, SparseMoE)):
        if isinstance(moe.experts, Experts | QuantizedExperts):
            bank_to(moe.experts, device)


class HostMirror(nn.Module):
    """A layer's experts held only as the pinned mirror, which the compiled CPU kernel reads in
    place: its tensors registered (not saved) so the shard counts their host bytes once."""

    def __init__(self, mirror: dict[str, torch.Tensor], num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        for name, tensor in mirror.items():
            self.register_buffer(name.replace(".", "_"), tensor, persistent=False)


# ---- the store ------------------------------------------------------------------------------


@dataclass
class StoreCounters:
    """Cumulative, per store (a layer); the agent's metrics read their sums."""

    steps: int = 0
    fetch_bytes: int = 0
    cpu_bytes: int = 0
    fetched: int = 0
    cpu_experts: int = 0
    prefetched: int = 0  # experts copied into slots ahead of the step that would use them
    prefetch_bytes: int = 0


class Lookahead(Protocol):
    """What a layer's store does for the next MoE layer while serving its own step
    (:mod:`.expert_prefetch` builds it): ``predict`` the next layer's experts from this layer's
    MoE input (ids [T, k] on x's device; they come to the host in the same copy as this layer's
    routing), then ``prefetch`` them (the ids on the host) into the next layer's slots, the
    copies queued behind ``after``, this layer's own (None: no device bank)."""

    def predict(self, x: torch.Tensor) -> torch.Tensor: ...

    def prefetch(self, index: torch.Tensor, after: torch.cuda.Event | None) -> None: ...


@dataclass
class StoreConfig:
    """How one layer's store serves misses. ``q``: the fetched share of miss bytes (None: q*
    once measured, 0 until then); ``cpu_workers``: the compiled CPU kernel's threads (torch's
    path, for banks the kernel does not take, runs one expert at a time on one worker with torch's
    intra-op threads inside: more Python workers starved the copies, docs/results)."""

    num_slots: int
    policy: EvictionPolicy = EvictionPolicy.LRU
    q: float | None = None
    cpu_workers: int = 1

    def __post_init__(self) -> None:
        if self.num_slots < 0 or self.cpu_workers < 1:
            raise InputError(
                f"an expert store needs num_slots >= 0 and cpu_workers >= 1, got {self.num_slots}, {self.cpu_workers}"
            )
        if self.q is not None and not 0.0 <= self.q <= 1.0:
            raise InputError(f"expert split q must be in [0, 1], got {self.q}")


class ExpertStore(nn.Module):
    """A layer's experts: host bank + device slots + hybrid miss service (see the module docstring)."""

    def __init__(
        self,
        host: Bank,
        device: torch.device,
        config: StoreConfig,
        pool: ThreadPoolExecutor | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ):
        super().__init__()
        self.device = torch.device(device)
        self.config = config
        self.q = 0.0 if config.q is None else config.q
        self.slot_map = SlotMap(config.num_slots, config.policy)
        # CUDA: a stacked slot bank filled from pinned host memory (the bank given may sit on the
        # device; it is released once the host side holds it); elsewhere: the stand-in slots. The
        # CPU share: the compiled kernel over the pinned mirror where it takes the bank (one copy
        # of each expert in host memory), else torch's kernels over a bank in their CPU layout
        self.device_bank: DeviceSlotBank | None = None
        self.cpu_kernel: cpu_experts.CpuExperts | None = None
        self.activation_dtype = dtype
        self.format = host.format if isinstance(host, QuantizedExperts) else _plain_format(host)
        on_host: Bank | HostMirror = host
        self.slots: SlotStorage | None = None
        if self.device.type == "cuda" and config.num_slots > 0:
            compiled = compiled_kernel_takes(host)
            self.device_bank = DeviceSlotBank(host, config.num_slots, self.device, dtype, cpu_layout=not compiled)
            mirror = self.device_bank.mirror
            self.cpu_kernel = compiled_cpu_share(mirror, host, config.cpu_workers) if compiled else None
            if self.cpu_kernel is not None:
                on_host = HostMirror(mirror, host.num_experts)
            else:
                on_host = self.device_bank.cpu_bank() or _cpu_bank(host, mirror, dtype)
            self.expert_nbytes = self.device_bank.expert_nbytes
        else:
            if self.device.type == "cuda":
                host = on_host = _cpu_bank(host, None, dtype)
            self.slots = SlotStorage(host, config.num_slots, self.device)
            self.expert_nbytes = expert_bytes(host)
        self.host = on_host  # a registered submodule: its bytes are the shard's expert bytes (host memory)
        self.counters = StoreCounters()
        self.bandwidths: Bandwidths | None = None  # set when q came from measured bandwidths
        self._pool = pool or ThreadPoolExecutor(1, thread_name_prefix="cpu-experts")
        self._lock = threading.Lock()  # one step at a time per layer
        self._luts: tuple[torch.Tensor, torch.Tensor] | None = None  # CUDA: expert -> slot, expert -> in a slot
        self._staged: tuple[torch.Tensor, torch.Tensor] | None = None  # their pinned staging
        self._luts_current = False  # False once the slots change outside a step (prefetch, reset)
        self.lookahead: Lookahead | None = None  # prefetch for the next MoE layer (engine.expert_prefetch)
        self._ahead: torch.Tensor | None = None  # this step's prediction for it, on the host, until prefetched

    @property
    def num_experts(self) -> int:
        return self.host.num_experts

    def reset(self, policy: EvictionPolicy | None = None, q: float | None = None) -> None:
        """Forget what the slots hold and the counters (a benchmark's next configuration, same banks)."""
        with self._lock:
            if policy is not None:
                self.config.policy = policy
            if q is not None:
                self.q = StoreConfig(self.config.num_slots, self.config.policy, q).q or 0.0
            self.slot_map = SlotMap(self.config.num_slots, self.config.policy)
            self.counters = StoreCounters()
            self._luts_current = False

    def prefetch(self, experts: Sequence[int], after: torch.cuda.Event | None = None) -> None:
        """Bring ``experts`` (most wanted first) into slots ahead of the step that will need them,
        as many as the slots hold, evicting by policy but never one of them. On CUDA the copies
        are queued on the side stream (behind ``after``) and the current stream goes on: the next
        step's slot kernel waits for them. Counted as prefetched, apart from the step's fetches."""
        with self._lock:
            loads = self.slot_map.admit_ahead(experts)
            if loads:
                self._luts_current = False  # the slot tables change with the slots
            self.counters.prefetched += len(loads)
            self.counters.prefetch_bytes += len(loads) * self.expert_nbytes
            if self.device_bank is not None:
                self.device_bank.fetch_ahead(loads, after)
            else:
                self._load(loads)

    def _routing_to_host(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The step's routing on the host; with a lookahead, the next layer's predicted experts
        come in the same copy (kept for :meth:`_look_ahead`)."""
        if self.lookahead is None:
            return index.to("cpu")
        k = index.shape[1]
        both = torch.cat([index, self.lookahead.predict(x).to(index.dtype)], dim=1).to("cpu")
        self._ahead = both[:, k:]
        return both[:, :k]

    def _look_ahead(self) -> None:
        """Prefetch the next layer's predicted experts (once a step), behind this step's own copies."""
        if self._ahead is None or self.lookahead is None:
            return
        ahead, self._ahead = self._ahead, None
        self.lookahead.prefetch(ahead, None if self.device_bank is None else self.device_bank.event)

    def _load(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Fill slot s with expert e for each (s, e): side-stream copies on CUDA, else the stand-in."""
        if self.device_bank is not None:
            self.device_bank.fetch(pairs)
            return
        assert self.slots is not None
        for slot, e in pairs:
            self.slots.load(slot, e)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x: [T, H]; index, weight: [T, k] -> sum_k weight * expert_index(x): [T, H]."""
        with self._lock:
            if self.device.type == "cuda" and x.is_cuda:
                return self._forward_device(x, index, weight)
            rows_of = _rows_by_expert(self._routing_to_host(x, index))
            outputs = self._serve(x, rows_of)
            self._look_ahead()
        return forward_grouped(lambda e, _rows: outputs[e], self.num_experts, x, index, weight)

    def _forward_device(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """CUDA: the step's routing comes to the host (its copy waits for the GPU; x and the
        weights come in the same wait); the fetched share is copied into slots on the side stream
        and the slot bank runs every device pair through the resident bank's kernels with ids
        remapped to slots by a device lookup table (a CPU pair's weight zeroed there), queued
        behind the copies; meanwhile the CPU share runs on this thread and the CPU kernel's pool;
        its partial sum comes back (pinned, asynchronously) and is added last. With no CPU share
        the result is the resident bank's, bit for bit."""
        x_host = x.to("cpu", non_blocking=True)
        weight_host = weight.to("cpu", non_blocking=True)
        index_host = self._routing_to_host(x, index)  # waits for the stream: x_host, weight_host are in too
        rows: dict[int, int] = {}
        for row in index_host.tolist():
            for e in row:
                rows[e] = rows.get(e, 0) + 1
        used = sorted(rows, key=lambda e: (-rows[e], e))  # the experts with most rows fetch first
        hits, misses = self.slot_map.lookup(used)
        pinned = set(used)
        fetch, on_cpu = split_misses(
            [(e, self.expert_nbytes) for e in misses], self.q, self.slot_map.free_capacity(pinned)
        )
        loads = [(self.slot_map.admit(e, pinned), e) for e in fetch]
        out: torch.Tensor | None = None
        self._load(loads)  # first, so the copies start at once (side stream; the slot kernel waits for them)
        if self.device_bank is not None and (hits or fetch):
            if loads or not self._luts_current or self._luts is None or self._luts[1].dtype != weight.dtype:
                self._refresh_luts(weight.dtype)
            assert self._luts is not None
            slot_lut, keep_lut = self._luts
            slot_index = slot_lut[index]
            device_weight = weight * keep_lut[index] if on_cpu else weight  # CPU pairs add 0 x slot 0
            out = self.device_bank.run(x, slot_index, device_weight)
        self._look_ahead()  # the next layer's copies overlap this step's CPU share and its attention
        if on_cpu:
            part = self._cpu_share(x_host, index_host, weight_host, on_cpu)
            part = part.to(self.device, non_blocking=True).to(x.dtype)
            out = part if out is None else out + part
        self._count(fetch, on_cpu)
        return out if out is not None else torch.zeros_like(x)

    def _refresh_luts(self, dtype: torch.dtype) -> None:
        """The device tables the slot kernel reads: each expert's slot (0 when it has none) and 1
        where it has one, else 0, in the routing weights' dtype; written through pinned staging
        made once (rewritten only after this store's next routing copy, which waits for this one)."""
        if self._staged is None or self._staged[1].dtype != dtype:
            e = self.num_experts
            self._staged = (
                torch.zeros(e, dtype=torch.int64).pin_memory(),
                torch.zeros(e, dtype=dtype).pin_memory(),
            )
            self._luts = (
                torch.zeros(e, dtype=torch.int64, device=self.device),
                torch.zeros(e, dtype=dtype, device=self.device),
            )
        slot_of = self.slot_map.slot_of
        slots, keep = self._staged
        slots.zero_()
        keep.zero_()
        if slot_of:
            held = torch.tensor(list(slot_of), dtype=torch.int64)
            slots[held] = torch.tensor(list(slot_of.values()), dtype=torch.int64)
            keep[held] = 1
        assert self._luts is not None
        self._luts[0].copy_(slots, non_blocking=True)
        self._luts[1].copy_(keep, non_blocking=True)
        self._luts_current = True

    def _serve(self, x: torch.Tensor, rows_of: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Every used expert's output over its rows: hits and fetched on the device, the rest on the CPU."""
        # prefer fetching the experts with the most rows: they amortise a fetch best
        used = sorted(rows_of, key=lambda e: (-rows_of[e].numel(), e))
        hits, misses = self.slot_map.lookup(used)
        pinned = set(used)
        fetch, on_cpu = split_misses(
            [(e, self.expert_nbytes) for e in misses], self.q, self.slot_map.free_capacity(pinned)
        )
        futures = self._launch_cpu(x, {e: rows_of[e] for e in on_cpu})
        outputs: dict[int, torch.Tensor] = {}
        self._load([(self.slot_map.admit(e, pinned), e) for e in fetch])
        assert self.slots is not None
        for e in (*hits, *fetch):
            rows = x[rows_of[e]].to(self.device)
            outputs[e] = self.slots.run(self.slot_map.slot_of[e], rows).to(x.device)
        for e, future in futures.items():
            outputs[e] = future.result().to(x.device)
        self._count(fetch, on_cpu)
        return outputs

    def _cpu_share(
        self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, on_cpu: Sequence[int]
    ) -> torch.Tensor:
        """[T, H] on the host (pinned on CUDA): each row's weighted sum over its pairs with an
        expert in ``on_cpu`` (the compiled kernel in one call, else one torch task per expert)."""
        if self.cpu_kernel is not None:
            return self.cpu_kernel(x, index, weight, set(on_cpu), pin_memory=self.device.type == "cuda")
        rows_of = _rows_by_expert(index)
        futures = self._launch_cpu(x, {e: rows_of[e] for e in on_cpu})
        cpu_sum = torch.zeros(x.shape, dtype=torch.float32)
        for e, future in futures.items():
            w_e = weight[index == e].float()  # one per row of e (an expert appears once per token)
            cpu_sum.index_add_(0, rows_of[e], future.result().float() * w_e[:, None])
        return cpu_sum

    def _count(self, fetch: Sequence[int], on_cpu: Sequence[int]) -> None:
        counters = self.counters
        counters.steps += 1
        counters.fetched += len(fetch)
        counters.cpu_experts += len(on_cpu)
        counters.fetch_bytes += len(fetch) * self.expert_nbytes
        counters.cpu_bytes += len(on_cpu) * self.expert_nbytes

    def _launch_cpu(self, x: torch.Tensor, rows_of: dict[int, torch.Tensor]) -> dict[int, Future[torch.Tensor]]:
        """One task per CPU expert, on the store's worker threads, reading the host bank in place."""
        x_host = x.to("cpu") if rows_of else x
        host = self.host
        assert isinstance(host, Experts | QuantizedExperts), "torch's CPU path needs a bank in its layout"
        return {e: self._pool.submit(host.expert, e, x_host[rows.to("cpu")]) for e, rows in rows_of.items()}

    @property
    def cpu_kernel_name(self) -> str:
        """What computes the CPU share: the compiled kernel (and its instruction set) or torch."""
        return f"compiled ({cpu_experts.instruction_set()})" if self.cpu_kernel is not None else "torch"

    def report(self) -> dict[str, object]:
        """This layer's placement and counters (the placement report's per-layer row)."""
        c, held = self.counters, self.slot_map.held()
        return {
            "slots": self.config.num_slots, "cached_experts": held, "host_experts": self.num_experts,
            "expert_bytes": self.expert_nbytes, "q": round(self.q, 4), "policy": str(self.config.policy),
            "hits": self.slot_map.hits, "misses": self.slot_map.misses, "fetch_bytes": c.fetch_bytes,
            "cpu_bytes": c.cpu_bytes, "steps": c.steps, "cpu_kernel": self.cpu_kernel_name,
            "prefetched": c.prefetched, "prefetch_bytes": c.prefetch_bytes, "prefetch_hits": self.slot_map.prefetch_hits,
        }  # fmt: skip


def _rows_by_expert(index: torch.Tensor) -> dict[int, torch.Tensor]:
    """{expert: the token rows routed to it, ascending} (the rows the grouped path gives it)."""
    tokens = torch.arange(index.shape[0], device=index.device)[:, None].expand_as(index).reshape(-1)
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    groups = torch.split(tokens[order], counts.tolist())
    return {int(e): rows for e, rows in zip(experts.tolist(), groups, strict=True)}


# ---- bandwidths, measured under contention --------------------------------------------------


@dataclass(frozen=True)
class Bandwidths:
    """beta_g: host-to-device expert copies, beta_c: CPU expert compute over packed banks (bytes
    per second), measured at once so each sees the other's memory traffic."""

    beta_g: float
    beta_c: float
    device: str
    device_is_stand_in: bool  # no accelerator: the "device" path copied within host memory
    seconds: float
    format: str
    cpu_workers: int  # the compiled kernel's threads (torch's path: one worker)
    cpu_kernel: str = "torch"

    @property
    def q_star(self) -> float:
        return q_star(self.beta_g, self.beta_c)

    def as_dict(self) -> dict[str, object]:
        return {
            "beta_g_bytes_per_second": round(self.beta_g), "beta_c_bytes_per_second": round(self.beta_c),
            "q_star": round(self.q_star, 4), "device": self.device, "device_is_stand_in": self.device_is_stand_in,
            "format": self.format, "cpu_workers": self.cpu_workers, "cpu_kernel": self.cpu_kernel,
            "seconds": self.seconds,
        }  # fmt: skip


FETCH_BATCH = 8  # expert copies per wait while measuring beta_g (a step's misses are copied together)


def _repeat_for(seconds: float, work: Callable[[int], int], stop: threading.Event) -> tuple[int, float]:
    """Run ``work(i)`` (returning bytes moved) until ``seconds`` pass or ``stop``; -> (bytes, elapsed)."""
    total, i = 0, 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds and not stop.is_set():
        total += work(i)
        i += 1
    return total, time.perf_counter() - start


def measure_bandwidths(store: ExpertStore, seconds: float = 0.5, dtype: torch.dtype = torch.float32) -> Bandwidths:
    """Copy experts into a slot and compute experts on the CPU at one row each, both at once, for
    ``seconds``; the betas are the bytes each path moved per second while the other ran. Both
    paths move a step's worth at a time: FETCH_BATCH experts copied, then a wait; the compiled
    kernel computes FETCH_BATCH experts a call (torch's, one expert a task on each worker)."""
    if store.config.num_slots < 1:
        raise InputError("measuring beta_g needs an expert store with at least one slot")
    host, nbytes, experts = store.host, store.expert_nbytes, store.num_experts
    kernel = store.cpu_kernel
    bank = store.device_bank
    held = store.slot_map.slots[0].expert  # slot 0 is the copies' target; refilled afterwards
    storage = None
    if bank is None:  # the stand-in's copies
        assert isinstance(host, Experts | QuantizedExperts)
        storage = SlotStorage(host, 1, store.device)
        storage.load(0, 0)
    if kernel is not None:
        row = torch.randn(1, kernel.hidden, dtype=dtype)
        group = min(FETCH_BATCH, experts)
        weight = torch.ones(1, group)

        def compute(i: int) -> int:
            index = ((torch.arange(group) + i * group) % experts)[None]
            kernel(row, index, weight, set(index[0].tolist()))
            return nbytes * group

        workers = 1  # the kernel's own threads compute each call
    else:
        assert isinstance(host, Experts | QuantizedExperts)
        row = torch.randn(1, _in_features(host), dtype=dtype)
        host.expert(0, row)  # kernel layouts are built on first use: not part of either bandwidth

        def compute(i: int) -> int:
            host.expert(i % experts, row)
            return nbytes

        workers = 1
    stop = threading.Event()
    cpu_threads = [store._pool.submit(_repeat_for, seconds, compute, stop) for _ in range(workers)]

    def fetch(i: int) -> int:
        if bank is None:
            assert storage is not None
            storage.load(0, i % experts)
            return nbytes
        # a step's worth of copies (pinned host -> the slot bank, side stream), then wait for them
        bank.fetch([(0, (i * FETCH_BATCH + j) % experts) for j in range(FETCH_BATCH)])
        torch.cuda.synchronize(store.device)
        return nbytes * FETCH_BATCH

    g_bytes, g_seconds = _repeat_for(seconds, fetch, stop)
    cpu = [f.result() for f in cpu_threads]
    if bank is not None and held is not None:
        bank.fetch([(0, held)])
        torch.cuda.synchronize(store.device)
    beta_c = sum(b for b, _ in cpu) / max(max(s for _, s in cpu), 1e-9)
    return Bandwidths(
        g_bytes / max(g_seconds, 1e-9), beta_c, str(store.device), store.device.type != "cuda", seconds, store.format,
        store.config.cpu_workers, store.cpu_kernel_name,
    )  # fmt: skip


def _plain_format(bank: Experts) -> str:
    """A plain bank's format name: its dtype (a oneDNN-packed one is bf16)."""
    return str(torch.bfloat16 if bank.packed is not None else bank.gate_up.dtype).removeprefix("torch.")


def _plain_in_features(bank: Experts) -> int:
    """H of a plain bank (a oneDNN-packed weight keeps its logical [out, in] shape)."""
    return int((bank.packed[0][0] if bank.packed is not None else bank.gate_up).shape[-1])
