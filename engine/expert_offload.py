"""Applying an expert placement (:mod:`.expert_placement`) to a loaded shard: each MoE layer the
device cannot hold gets an :class:`~.expert_store.ExpertStore`, q* is measured once for the
stage, and the stores report their placement and counters (for ``generate --json``, the stage
agent's /status and metrics).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from .expert_placement import (
    DEFAULT_EXPERT_PREFETCH,
    ExpertPrefetch,
    LayerPlacement,
    MoELayer,
    Placement,
    StagePlacement,
    plan_expert_placement,
)
from .expert_prefetch import install_prefetch
from .expert_store import (
    Bank,
    EvictionPolicy,
    ExpertStore,
    StoreConfig,
    bank_to,
    expert_bytes,
    measure_bandwidths,
)
from .layers import Experts, SparseMoE
from .quantize import QuantizedExperts

if TYPE_CHECKING:
    from .shard import Shard


def moe_banks(root: nn.Module) -> dict[int, SparseMoE]:
    """{layer index within ``root.layers``: its sparse MoE block} for every MoE layer."""
    layers = getattr(root, "layers", [])
    return {i: m for i, layer in enumerate(layers) for m in layer.modules() if isinstance(m, SparseMoE)}


def moe_layers(root: nn.Module, layer_start: int = 0) -> list[MoELayer]:
    """Each MoE layer's bank size (absolute layer numbers), for :func:`plan_expert_placement`."""
    out = []
    for i, moe in moe_banks(root).items():
        if isinstance(moe.experts, ExpertStore):
            out.append(MoELayer(layer_start + i, moe.experts.num_experts, moe.experts.expert_nbytes))
        elif isinstance(moe.experts, Experts | QuantizedExperts):
            out.append(MoELayer(layer_start + i, moe.experts.num_experts, expert_bytes(moe.experts)))
    return out


def default_cpu_workers() -> int:
    """Threads for the CPU share when none are given: every CPU this process may run on but one
    (left to the thread that drives the device)."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


@dataclass(frozen=True)
class StoreOptions:
    """How offloaded layers serve misses (the same for every layer of a stage)."""

    policy: EvictionPolicy = EvictionPolicy.LRU
    q: float | None = None  # None: q* from bandwidths measured at startup
    cpu_workers: int = field(default_factory=lambda: default_cpu_workers())  # the compiled kernel's threads
    measure_seconds: float = 0.2
    prefetch: ExpertPrefetch = DEFAULT_EXPERT_PREFETCH  # into slots ahead of the step (engine.expert_prefetch)


def apply_placement(
    root: nn.Module,
    placement: StagePlacement,
    device: torch.device,
    options: StoreOptions,
    layer_start: int = 0,
    dtype: torch.dtype = torch.float32,
) -> list[ExpertStore]:
    """Wrap, in place, every MoE layer that the placement does not keep on the device in an
    :class:`ExpertStore` (one worker pool for the stage); with ``options.q`` None, q* is measured
    once (both paths at once, activations in ``dtype``) and given to every store. Returns the stores."""
    by_layer = placement.by_layer()
    pool = ThreadPoolExecutor(1, thread_name_prefix="cpu-experts")  # torch's path (ExpertStore's docstring)
    stores = []
    for i, moe in moe_banks(root).items():
        chosen: LayerPlacement | None = by_layer.get(layer_start + i)
        if not isinstance(moe.experts, Bank):
            continue
        if chosen is None or chosen.placement is Placement.DEVICE:
            if _bank_device(moe.experts).type != device.type:  # loaded to the host (experts_on_host): it fits after all
                bank_to(moe.experts, device)
            continue
        config = StoreConfig(chosen.slots, options.policy, options.q, options.cpu_workers)
        moe.experts = ExpertStore(moe.experts, device, config, pool, _activation_dtype(moe.experts, dtype))
        stores.append(moe.experts)
    if stores and device.type == "cuda":  # the offloaded banks' device copies are gone: give their memory back
        torch.cuda.empty_cache()
    with_slots = [store for store in stores if store.config.num_slots > 0]
    if with_slots and options.q is None:  # no slot anywhere: nothing can be fetched, q stays 0
        measured = measure_bandwidths(with_slots[0], options.measure_seconds, with_slots[0].activation_dtype)
        for store in stores:
            store.q = measured.q_star
            store.bandwidths = measured
    return stores


def offload_experts(
    shard: Shard, device_bytes: int | None, host_bytes: int | None, options: StoreOptions, kv_bytes: int | None = None
) -> StagePlacement:
    """Plan a loaded shard's expert placement for ``device_bytes`` of device memory (its weights
    as they are now, its KV as allocated or ``kv_bytes`` when it is still to be), apply it and
    wire the stores' prefetch as ``options.prefetch`` says."""
    layers = moe_layers(shard, shard.layer_start)
    other = shard.weights_bytes - sum(m.bank_bytes for m in layers) + (shard.kv_bytes if kv_bytes is None else kv_bytes)
    placement = plan_expert_placement(layers, other, device_bytes, host_bytes)
    apply_placement(shard, placement, shard.device, options, shard.layer_start, shard.dtype)
    frame_prefetch = install_prefetch(list(moe_banks(shard).values()), options.prefetch)
    if frame_prefetch is not None:
        shard.before_step.append(frame_prefetch)
    return placement


def _activation_dtype(bank: Bank, compute: torch.dtype) -> torch.dtype:
    """What the bank's experts are called with: the compute dtype (a plain bank: its own)."""
    if isinstance(bank, QuantizedExperts):
        return compute
    return torch.bfloat16 if bank.packed is not None else bank.gate_up.dtype


def _bank_device(bank: Bank) -> torch.device:
    return bank.gate_up.device


def stores_of(root: nn.Module) -> list[ExpertStore]:
    return [m for m in root.modules() if isinstance(m, ExpertStore)]


def expert_counters(stores: Sequence[ExpertStore]) -> dict[str, object]:
    """Every store's report row and the summed counters (hits, misses, fetch/cpu bytes, prefetch)."""
    totals = {"hits": 0, "misses": 0, "fetch_bytes": 0, "cpu_bytes": 0, "prefetched": 0, "prefetch_bytes": 0,
              "prefetch_hits": 0}  # fmt: skip
    rows = []
    for store in stores:
        row = store.report()
        rows.append(row)
        for key in totals:
            totals[key] += int(row[key])  # type: ignore[call-overload]
    return {"stores": rows, **totals}


def placement_report(stores: Sequence[ExpertStore], placement: StagePlacement | None) -> dict[str, object]:
    """The stage's placement table and counters: per layer what is cached/host, in sum the bytes
    on each side, the q in use and the measured bandwidths."""
    measured = next((s.bandwidths for s in stores if s.bandwidths is not None), None)
    return {
        "offloaded": bool(stores),
        "device_cap_bytes": None if placement is None else placement.device_bytes,
        "device_reserve_bytes": 0 if placement is None else placement.reserve_bytes,
        "expert_device_bytes": 0 if placement is None else placement.expert_device_bytes,
        "expert_host_bytes": 0 if placement is None else placement.expert_host_bytes,
        "q": None if not stores else stores[0].q,
        "bandwidths": None if measured is None else measured.as_dict(),
        "layers": [p.as_dict() for p in placement.layers] if placement is not None else [],
        **expert_counters(stores),
    }
