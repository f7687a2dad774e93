"""Where each MoE layer's experts live, decided from device and host memory separately (pure).

A stage whose whole shard fits its device keeps every expert there (``device``). Otherwise the
experts move to host banks (in their format, never a full-precision copy) and the device memory
left after the non-expert weights, the KV reservation and a reserve for CUDA-graph capture and
activations is shared evenly among the MoE layers as cache slots (``cached``); a layer given no
slot is ``host``: its misses all run on the CPU. Seed 001 found graph memory and cache slots
compete, so the reserve is taken before the slots are counted.

Errors name both sizes: a device too small even for the non-expert part, or a host too small
for the banks the device cannot hold.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import InputError

MiB = 1 << 20
# CUDA-graph capture buffers and activations: a tenth of the device, at most 512 MiB (seed 001's
# graphs took a few hundred MiB on 16 GiB cards)
MAX_DEVICE_RESERVE_BYTES = 512 * MiB


class Placement(enum.StrEnum):
    DEVICE = "device"  # the whole bank on the device
    CACHED = "cached"  # host bank + device slots for hot experts
    HOST = "host"  # host bank only: misses run on the CPU


class ExpertPrefetch(enum.StrEnum):
    """What cached layers' slots are filled with ahead of the step (engine.expert_prefetch)."""

    OFF = "off"
    EXACT = "exact"  # hash-routed layers only: their experts follow from the token ids
    # also learned routers: the next layer's router on this layer's input (on tiny trained models
    # 67-89% of what it copied was used, docs/results/expert_prefetch_cpu.md)
    PREDICTED = "predicted"


# exact by default: it never copies an expert the step will not use. predicted copies up to a
# layer's slots of guesses every step (a wrong one costs copy bandwidth the split could have given
# the CPU, which outran the copies on the H200 box: beta_c 35-43 vs beta_g 29-33 GB/s) and its
# decode rate on a GPU is not measured yet; a user turns it on (--expert-prefetch predicted)
DEFAULT_EXPERT_PREFETCH = ExpertPrefetch.EXACT


@dataclass(frozen=True)
class MoELayer:
    """One MoE layer's routed-expert bank, as held (packed formats at their packed size)."""

    layer: int
    num_experts: int
    expert_bytes: int

    @property
    def bank_bytes(self) -> int:
        return self.num_experts * self.expert_bytes


@dataclass(frozen=True)
class LayerPlacement:
    layer: int
    placement: Placement
    slots: int  # device-resident experts (all of them for ``device``)
    expert_bytes: int
    num_experts: int

    @property
    def device_bytes(self) -> int:
        return self.slots * self.expert_bytes

    @property
    def host_bytes(self) -> int:
        return 0 if self.placement is Placement.DEVICE else self.num_experts * self.expert_bytes

    def as_dict(self) -> dict[str, object]:
        return {"layer": self.layer, "placement": str(self.placement), "slots": self.slots,
                "num_experts": self.num_experts, "device_bytes": self.device_bytes, "host_bytes": self.host_bytes}  # fmt: skip


@dataclass(frozen=True)
class StagePlacement:
    layers: tuple[LayerPlacement, ...]
    device_bytes: int | None  # the cap (None: not capped)
    reserve_bytes: int
    other_bytes: int  # non-expert weights + KV on the device

    @property
    def offloaded(self) -> bool:
        return any(p.placement is not Placement.DEVICE for p in self.layers)

    @property
    def expert_device_bytes(self) -> int:
        return sum(p.device_bytes for p in self.layers)

    @property
    def expert_host_bytes(self) -> int:
        return sum(p.host_bytes for p in self.layers)

    def by_layer(self) -> dict[int, LayerPlacement]:
        return {p.layer: p for p in self.layers}


def device_reserve_bytes(device_bytes: int) -> int:
    return min(MAX_DEVICE_RESERVE_BYTES, device_bytes // 10)


def _bytes(n: int) -> str:
    return f"{n} bytes ({n / (1 << 30):.2f} GiB)" if n >= 1 << 30 else f"{n} bytes"


def plan_expert_placement(
    layers: Sequence[MoELayer], other_bytes: int, device_bytes: int | None, host_bytes: int | None = None
) -> StagePlacement:
    """Each MoE layer's placement. ``other_bytes``: what must sit on the device besides routed
    experts (attention, shared experts, norms, embeddings/head, KV); ``device_bytes``: the device
    memory to plan for (None: unlimited, everything on the device); ``host_bytes``: host memory
    for banks (None: not checked)."""
    if device_bytes is None:
        return StagePlacement(tuple(_on_device(m) for m in layers), None, 0, other_bytes)
    reserve = device_reserve_bytes(device_bytes)
    free = device_bytes - reserve - other_bytes
    if free >= sum(m.bank_bytes for m in layers):
        return StagePlacement(tuple(_on_device(m) for m in layers), device_bytes, reserve, other_bytes)
    if free < 0:
        raise InputError(
            f"device memory {_bytes(device_bytes)} cannot hold the stage's non-expert weights and KV "
            f"({_bytes(other_bytes)}) plus the capture/activation reserve ({_bytes(reserve)}); give the device more "
            "memory (gpuMemoryBytes / --gpu-memory-bytes) or cut the model into more stages"
        )
    need_host = sum(m.bank_bytes for m in layers)
    if host_bytes is not None and need_host > host_bytes:
        raise InputError(
            f"the stage's expert banks need {_bytes(need_host)} of host memory but the host has {_bytes(host_bytes)}, "
            f"and the device ({_bytes(device_bytes)}, {_bytes(max(free, 0))} free for experts) cannot hold them "
            "either; add host or device memory, or cut the model into more stages"
        )
    return StagePlacement(_share_slots(layers, free), device_bytes, reserve, other_bytes)


def _on_device(m: MoELayer) -> LayerPlacement:
    return LayerPlacement(m.layer, Placement.DEVICE, m.num_experts, m.expert_bytes, m.num_experts)


def _share_slots(layers: Sequence[MoELayer], free: int) -> tuple[LayerPlacement, ...]:
    """Slots in turn, one per layer per round, while the next one fits: an even share of the
    free device memory (layers of different expert sizes each get the same count)."""
    slots = [0] * len(layers)
    left = free
    progress = True
    while progress:
        progress = False
        for i, m in enumerate(layers):
            if slots[i] < m.num_experts and m.expert_bytes <= left:
                slots[i] += 1
                left -= m.expert_bytes
                progress = True
    return tuple(LayerPlacement(m.layer, _kind(n, m.num_experts), n, m.expert_bytes, m.num_experts)
                 for m, n in zip(layers, slots, strict=True))  # fmt: skip


def _kind(slots: int, num_experts: int) -> Placement:
    return Placement.DEVICE if slots == num_experts else Placement.CACHED if slots else Placement.HOST
