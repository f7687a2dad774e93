"""CPU cores for stage processes: which cores each local process is pinned to, and how many
compute threads a stage runs, from what it is allotted.

A stage's torch threads must not exceed its cores: on a CPU, a parallel op ends in a barrier, and
a thread that shares its core with another process's makes every op wait for a time slice (on
the 2-core development machine, two 2-thread stages decoded up to 10x slower than 1-thread
ones). The allotment is the smallest of: the process's CPU affinity (the local launcher pins each
process to a disjoint set of cores), a cgroup CPU quota (a Kubernetes pod's CPU limit, which
``os.cpu_count()`` and torch's default ignore), and an explicit request (``OMP_NUM_THREADS``).
The decisions are pure functions; :func:`size_threads` reads the process's state and applies them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "<quota> <period>" or "max <period>"


def cpu_quota(cpu_max: str | None) -> float | None:
    """CPUs a cgroup v2 ``cpu.max`` line allows (``"200000 100000"`` -> 2.0); None when unlimited or unreadable."""
    parts = (cpu_max or "").split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def stage_threads(affinity_cpus: int, quota_cpus: float | None = None, requested: int | None = None) -> int:
    """Compute threads for a stage: its allotted cores (affinity, capped by a quota, rounded down),
    or fewer when ``requested``; at least 1."""
    allotted = affinity_cpus if quota_cpus is None else min(affinity_cpus, math.floor(quota_cpus))
    if requested is not None and requested > 0:
        allotted = min(allotted, requested)
    return max(1, allotted)


def core_sets(cpus: Sequence[int], processes: int) -> list[tuple[int, ...]]:
    """Cores for each of ``processes`` local processes: disjoint runs of consecutive cores, as even as
    can be (sizes differ by at most one); with more processes than cores, one core each, in turn."""
    if processes < 1 or not cpus:
        raise ValueError(f"need at least one process and one core, got {processes} processes on {list(cpus)}")
    if processes > len(cpus):
        return [(cpus[i % len(cpus)],) for i in range(processes)]
    base, extra = divmod(len(cpus), processes)
    sets, start = [], 0
    for i in range(processes):
        size = base + (1 if i < extra else 0)
        sets.append(tuple(cpus[start : start + size]))
        start += size
    return sets


def available_cpus() -> list[int]:
    """The cores this process may run on (its affinity; every core where the OS has no affinity)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _requested_threads() -> int | None:
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() else None


def size_threads() -> int:
    """Set torch's compute threads to this process's allotment (see the module docstring); returns it."""
    import torch

    try:
        quota = cpu_quota(CGROUP_CPU_MAX.read_text())
    except OSError:
        quota = None
    threads = stage_threads(len(available_cpus()), quota, _requested_threads())
    torch.set_num_threads(threads)
    return threads
