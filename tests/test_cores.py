"""Stage processes' cores and threads (agent/cores.py): pure decisions, table-tested."""

from __future__ import annotations

import pytest

from modelfleet.agent.cores import core_sets, cpu_quota, stage_threads


@pytest.mark.parametrize(
    ("cpu_max", "cpus"),
    [("200000 100000", 2.0), ("150000 100000", 1.5), ("max 100000", None), ("", None), (None, None), ("x y", None)],
)
def test_a_cgroup_cpu_max_line_gives_the_cpus_it_allows(cpu_max: str | None, cpus: float | None) -> None:
    assert cpu_quota(cpu_max) == cpus


@pytest.mark.parametrize(
    ("affinity", "quota", "requested", "threads"),
    [
        (16, None, None, 16),  # a whole machine
        (16, 2.0, None, 2),  # a pod limited to 2 CPUs on a 16-core node (torch's default would take 16)
        (16, 1.5, None, 1),  # a fractional limit rounds down
        (16, 0.5, None, 1),  # at least one thread
        (1, None, None, 1),  # pinned to one core by the local launcher
        (8, None, 3, 3),  # OMP_NUM_THREADS asks for fewer
        (2, None, 8, 2),  # ...never for more than the allotment
    ],
)
def test_a_stage_runs_as_many_threads_as_it_is_allotted_cores(affinity, quota, requested, threads) -> None:
    assert stage_threads(affinity, quota, requested) == threads


@pytest.mark.parametrize(
    ("cpus", "processes", "sets"),
    [
        ([0, 1], 2, [(0,), (1,)]),
        ([0, 1], 1, [(0, 1)]),
        (list(range(16)), 3, [(0, 1, 2, 3, 4, 5), (6, 7, 8, 9, 10), (11, 12, 13, 14, 15)]),
        ([0, 1], 3, [(0,), (1,), (0,)]),  # more processes than cores: one core each, in turn
        ([2, 5, 7], 2, [(2, 5), (7,)]),  # the cores the launcher itself may use
    ],
)
def test_local_processes_get_disjoint_even_shares_of_the_cores(cpus, processes, sets) -> None:
    assert core_sets(cpus, processes) == sets


def test_core_sets_refuses_no_processes() -> None:
    with pytest.raises(ValueError, match="at least one process"):
        core_sets([0, 1], 0)
