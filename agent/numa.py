"""NUMA placement of a stage's ranks: read the machine, decide, bind, verify.

Seed 001's expert banks must live in the host memory of the socket that hosts the rank's GPU,
first-touched by threads already pinned there ("First touch, or the banks scatter"). So a rank
binds its CPU affinity and memory policy *before* any large allocation (the agent calls
:func:`bind_rank` before its shard loads), and verifies afterwards from ``/proc/self/numa_maps``.

Three parts, each testable alone:
- reading (:func:`read_topology`): the allowed CPU mask, each NUMA node's CPUs, each CPU's thread
  siblings (all from sysfs/procfs under a ``root`` so tests use fake trees), and each CUDA
  device's PCI bus id and node (``/sys/bus/pci/devices/<bus id>/numa_node``);
- deciding (:func:`plan_bindings`, pure): ranks go to their GPU-local node; a node's allowed
  physical cores are split among its ranks in contiguous runs; each rank gets one coordinator
  core and the rest as CPU workers (one thread per physical core);
- doing (:func:`apply_binding`): ``sched_setaffinity`` and ``set_mempolicy(MPOL_PREFERRED)``
  through libnuma when present (otherwise the memory side is reported as logical only).

Invariant: a machine with one NUMA node is never bound (there is nothing to place), unless asked.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MPOL_PREFERRED = 1  # allocations prefer the node and fall back when it is full (never an OOM from binding)


@dataclass(frozen=True)
class Topology:
    """What a process may use. ``nodes``: node -> its CPUs (only allowed ones); ``cores``: physical
    cores as tuples of sibling CPUs (only allowed ones); ``gpu_nodes``: per CUDA device index, its
    node (None: unknown, e.g. no sysfs entry or numa_node -1)."""

    allowed_cpus: tuple[int, ...]
    nodes: dict[int, tuple[int, ...]]
    cores: tuple[tuple[int, ...], ...]
    gpu_bus_ids: tuple[str, ...] = ()
    gpu_nodes: tuple[int | None, ...] = ()

    def node_of_cpu(self, cpu: int) -> int | None:
        return next((node for node, cpus in self.nodes.items() if cpu in cpus), None)

    def cores_of_node(self, node: int) -> list[tuple[int, ...]]:
        return [core for core in self.cores if self.node_of_cpu(core[0]) == node]


@dataclass(frozen=True)
class RankBinding:
    """Where one rank runs: its node, its CPUs (all siblings of its physical cores), the
    coordinator CPU (the rank's own thread) and one CPU per worker (one per further core)."""

    rank: int
    device: int | None
    node: int | None
    cpus: tuple[int, ...]
    coordinator: int
    workers: tuple[int, ...]

    def as_dict(self) -> dict[str, object]:
        return {
            "rank": self.rank, "device": self.device, "numa_node": self.node, "cpus": format_cpulist(self.cpus),
            "coordinator_cpu": self.coordinator, "cpu_workers": len(self.workers),
        }  # fmt: skip


@dataclass
class BindResult:
    """What :func:`apply_binding` did; ``memory_policy``: "preferred node N", "logical only (…)" or "not bound"."""

    binding: RankBinding
    cpu_bound: bool
    memory_policy: str
    numa_maps_bytes: dict[int, int] = field(default_factory=dict)  # filled by :func:`verify`

    def as_dict(self) -> dict[str, object]:
        placed = {f"N{node}": nbytes for node, nbytes in sorted(self.numa_maps_bytes.items())}
        return {**self.binding.as_dict(), "cpu_bound": self.cpu_bound, "memory_policy": self.memory_policy,
                "resident_bytes_by_node": placed}  # fmt: skip


# ---- reading --------------------------------------------------------------------------------


def parse_cpulist(text: str) -> tuple[int, ...]:
    """'0-3,8,10-11' -> (0, 1, 2, 3, 8, 10, 11); '' -> ()."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"not a CPU list: {text!r} (expected e.g. '0-3,8')")
        cpus.extend(range(int(low), int(high or low) + 1))
    return tuple(sorted(set(cpus)))


def format_cpulist(cpus: Sequence[int]) -> str:
    """(0, 1, 2, 5) -> '0-2,5'."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def allowed_cpus(root: Path) -> tuple[int, ...]:
    """The process's allowed CPUs: ``Cpus_allowed_list`` of ``root/proc/self/status`` (the real
    root: ``os.sched_getaffinity``, which also sees a parent's taskset)."""
    if root == Path("/"):
        return tuple(sorted(os.sched_getaffinity(0)))
    status = _read(root / "proc/self/status") or ""
    match = re.search(r"^Cpus_allowed_list:\s*(\S+)", status, re.MULTILINE)
    if match is None:
        raise ValueError(f"{root / 'proc/self/status'} has no Cpus_allowed_list")
    return parse_cpulist(match.group(1))


def pci_numa_node(bus_id: str, root: Path = Path("/")) -> int | None:
    """The node sysfs gives a PCI device (bus id like '0000:3B:00.0'), None when absent or -1."""
    text = _read(root / "sys/bus/pci/devices" / bus_id.lower() / "numa_node")
    if text is None or not text.strip().lstrip("-").isdigit():
        return None
    node = int(text)
    return node if node >= 0 else None


def cuda_bus_ids() -> tuple[str, ...]:
    """Each visible CUDA device's PCI bus id ('dddd:bb:dd.0'); () without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return ()
    ids = []
    for index in range(torch.cuda.device_count()):
        p: Any = torch.cuda.get_device_properties(index)  # the PCI fields are missing from torch's stubs
        ids.append(f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0")
    return tuple(ids)


def read_topology(root: Path | str = "/", bus_ids: Sequence[str] | None = None) -> Topology:
    """The machine as this process may use it. ``bus_ids``: the CUDA devices' PCI bus ids
    (default: asked of torch on the real root, none on a fake one)."""
    root = Path(root)
    allowed = set(allowed_cpus(root))
    nodes: dict[int, tuple[int, ...]] = {}
    for entry in sorted((root / "sys/devices/system/node").glob("node[0-9]*")):
        cpus = tuple(c for c in parse_cpulist(_read(entry / "cpulist") or "") if c in allowed)
        if cpus:
            nodes[int(entry.name[4:])] = cpus
    if not nodes:  # no NUMA information (a container without sysfs nodes): one node of everything
        nodes = {0: tuple(sorted(allowed))}
    cores: dict[tuple[int, ...], None] = {}
    for cpu in sorted(allowed):
        text = _read(root / f"sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        siblings = parse_cpulist(text) if text else (cpu,)
        cores[tuple(c for c in siblings if c in allowed)] = None
    ids = tuple(cuda_bus_ids() if bus_ids is None and root == Path("/") else bus_ids or ())
    return Topology(tuple(sorted(allowed)), nodes, tuple(cores), ids, tuple(pci_numa_node(b, root) for b in ids))


# ---- deciding (pure) ------------------------------------------------------------------------


def rank_nodes(topology: Topology, devices: Sequence[int | None]) -> list[int]:
    """Each rank's node: its GPU's node when known; otherwise (CPU ranks, unknown nodes) the
    nodes in turn, so CPU ranks spread over the sockets."""
    node_ids = sorted(topology.nodes)
    chosen = []
    spread = 0
    for device in devices:
        known = topology.gpu_nodes[device] if device is not None and device < len(topology.gpu_nodes) else None
        if known is not None and known in topology.nodes:
            chosen.append(known)
        else:
            chosen.append(node_ids[spread % len(node_ids)])
            spread += 1
    return chosen


def split_cores(cores: Sequence[tuple[int, ...]], parts: int) -> list[list[tuple[int, ...]]]:
    """Contiguous runs of physical cores, sizes differing by at most one; with fewer cores than
    parts, parts share cores in turn (every part gets at least one)."""
    if len(cores) < parts:
        return [[cores[i % len(cores)]] for i in range(parts)]
    base, extra = divmod(len(cores), parts)
    runs, start = [], 0
    for i in range(parts):
        size = base + (i < extra)
        runs.append(list(cores[start : start + size]))
        start += size
    return runs


def plan_bindings(topology: Topology, devices: Sequence[int | None]) -> tuple[RankBinding, ...]:
    """One binding per rank (``devices[r]``: rank r's CUDA device index, None for a CPU rank)."""
    nodes = rank_nodes(topology, devices)
    bindings: list[RankBinding | None] = [None] * len(devices)
    for node in sorted(set(nodes)):
        ranks = [r for r, n in enumerate(nodes) if n == node]
        for rank, run in zip(ranks, split_cores(topology.cores_of_node(node), len(ranks)), strict=True):
            cpus = tuple(sorted(c for core in run for c in core))
            bindings[rank] = RankBinding(rank, devices[rank], node, cpus, run[0][0], tuple(core[0] for core in run[1:]))
    return tuple(b for b in bindings if b is not None)


# ---- doing and verifying --------------------------------------------------------------------


def _libnuma() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("numa") or "libnuma.so.1"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None
    return lib if lib.numa_available() >= 0 else None


def set_preferred_node(node: int) -> str:
    """set_mempolicy(MPOL_PREFERRED, {node}) for this thread and the threads it starts next."""
    lib = _libnuma()
    if lib is None:
        return "logical only (libnuma not found: memory follows first touch by the pinned threads)"
    mask = (ctypes.c_ulong * (node // 64 + 1))()
    mask[node // 64] = 1 << (node % 64)
    if lib.set_mempolicy(MPOL_PREFERRED, mask, ctypes.c_ulong(64 * len(mask) + 1)) != 0:
        return f"logical only (set_mempolicy failed: {os.strerror(ctypes.get_errno())})"
    return f"preferred node {node}"


def apply_binding(binding: RankBinding, topology: Topology, force: bool = False) -> BindResult:
    """Bind this process's CPU affinity and memory policy to ``binding``. A single-node machine
    is left alone unless ``force`` (nothing to place; pinning would only shrink the CPU set)."""
    if len(topology.nodes) < 2 and not force:
        return BindResult(binding, False, "not bound (one NUMA node)")
    os.sched_setaffinity(0, binding.cpus)
    policy = "not bound (no node)" if binding.node is None else set_preferred_node(binding.node)
    return BindResult(binding, True, policy)


def numa_map_bytes(text: str) -> dict[int, int]:
    """Resident bytes per node from ``/proc/<pid>/numa_maps`` text ('N0=12 ... kernelpagesize_kB=4')."""
    totals: dict[int, int] = {}
    for line in text.splitlines():
        page = re.search(r"kernelpagesize_kB=(\d+)", line)
        page_bytes = 1024 * int(page.group(1)) if page else 4096
        for node, pages in re.findall(r"\bN(\d+)=(\d+)", line):
            totals[int(node)] = totals.get(int(node), 0) + int(pages) * page_bytes
    return totals


def read_numa_maps(root: Path | str = "/") -> str:
    """This process's ``numa_maps`` ('' where the kernel has none)."""
    return _read(Path(root) / "proc/self/numa_maps") or ""


def verify(result: BindResult, root: Path | str = "/") -> BindResult:
    """Fill in where this process's pages actually are (from ``numa_maps``; empty if unreadable)."""
    result.numa_maps_bytes = numa_map_bytes(read_numa_maps(root))
    return result


def bind_rank(rank: int, devices: Sequence[int | None], root: Path | str = "/", force: bool = False) -> BindResult:
    """Read the machine, plan every rank of this process's group, bind ``rank`` (before loading)."""
    topology = read_topology(root)
    return apply_binding(plan_bindings(topology, devices)[rank], topology, force)


def device_index(device: str) -> int | None:
    """'cuda:1' -> 1, 'cuda' -> 0, anything else (cpu, OpenVINO devices) -> None."""
    if device == "cuda":
        return 0
    match = re.fullmatch(r"cuda:(\d+)", device)
    return int(match.group(1)) if match else None
