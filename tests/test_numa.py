"""NUMA placement (agent.numa) against fake sysfs trees: seed 001's workstation (2 sockets of 20
cores with hyper-threads, GPUs 0-1 on node 0 and 2-3 on node 1) and a single-node machine."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from modelfleet.agent import numa

SEED_BUS_IDS = ("0000:1a:00.0", "0000:3b:00.0", "0000:86:00.0", "0000:af:00.0")


def fake_machine(
    root: Path,
    nodes: dict[int, range],
    threads_per_core: int,
    allowed: str,
    gpu_nodes: dict[str, int] | None = None,
) -> Path:
    """A sysfs/procfs tree: node N holds physical cores ``nodes[N]``; core c's siblings are
    c, c + cores, ... (Linux numbering: first threads, then second threads)."""
    cores = sum(len(r) for r in nodes.values())
    for node, core_range in nodes.items():
        cpus = [c + t * cores for t in range(threads_per_core) for c in core_range]
        (root / f"sys/devices/system/node/node{node}").mkdir(parents=True)
        (root / f"sys/devices/system/node/node{node}/cpulist").write_text(numa.format_cpulist(cpus) + "\n")
    for core in range(cores):
        siblings = [core + t * cores for t in range(threads_per_core)]
        for cpu in siblings:
            path = root / f"sys/devices/system/cpu/cpu{cpu}/topology"
            path.mkdir(parents=True)
            (path / "thread_siblings_list").write_text(numa.format_cpulist(siblings) + "\n")
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/status").write_text(f"Name:\tpython\nCpus_allowed_list:\t{allowed}\n")
    for bus_id, node in (gpu_nodes or {}).items():
        (root / f"sys/bus/pci/devices/{bus_id}").mkdir(parents=True)
        (root / f"sys/bus/pci/devices/{bus_id}/numa_node").write_text(f"{node}\n")
    return root


@pytest.fixture
def seed_box(tmp_path: Path) -> Path:
    gpus = dict(zip(SEED_BUS_IDS, (0, 0, 1, 1), strict=True))
    return fake_machine(tmp_path, {0: range(0, 20), 1: range(20, 40)}, 2, "0-79", gpus)


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0-3,8,10-11", (0, 1, 2, 3, 8, 10, 11)), ("5", (5,)), ("", ()), ("3,1-2\n", (1, 2, 3))],
)
def test_cpu_lists_parse_and_format_round_trip(text: str, cpus: tuple[int, ...]) -> None:
    assert numa.parse_cpulist(text) == cpus
    assert numa.parse_cpulist(numa.format_cpulist(cpus)) == cpus


def test_a_malformed_cpu_list_is_refused_with_an_example() -> None:
    with pytest.raises(ValueError, match="expected e.g."):
        numa.parse_cpulist("0-x")


def test_the_seed_workstation_reads_as_two_nodes_of_twenty_cores_with_gpus_two_per_node(seed_box: Path) -> None:
    topology = numa.read_topology(seed_box, SEED_BUS_IDS)
    assert sorted(topology.nodes) == [0, 1]
    assert len(topology.cores) == 40 and all(len(core) == 2 for core in topology.cores)
    assert topology.gpu_nodes == (0, 0, 1, 1)
    assert topology.cores_of_node(1)[0] == (20, 60)


def test_four_ranks_get_their_gpu_local_node_and_ten_cores_each_one_coordinator_nine_workers(seed_box: Path) -> None:
    topology = numa.read_topology(seed_box, SEED_BUS_IDS)
    bindings = numa.plan_bindings(topology, [0, 1, 2, 3])
    assert [b.node for b in bindings] == [0, 0, 1, 1]
    assert [len(b.workers) for b in bindings] == [9, 9, 9, 9]
    assert bindings[0].cpus == (*range(0, 10), *range(40, 50))
    assert bindings[3].coordinator == 30 and bindings[3].workers[0] == 31
    assert not set(bindings[0].cpus) & set(bindings[1].cpus)


def test_ranks_follow_their_gpus_not_their_rank_order(seed_box: Path) -> None:
    topology = numa.read_topology(seed_box, SEED_BUS_IDS)
    assert [b.node for b in numa.plan_bindings(topology, [3, 0])] == [1, 0]


def test_cpu_ranks_and_gpus_without_a_node_spread_over_the_sockets(tmp_path: Path) -> None:
    root = fake_machine(tmp_path, {0: range(0, 4), 1: range(4, 8)}, 1, "0-7", {"0000:01:00.0": -1})
    topology = numa.read_topology(root, ["0000:01:00.0"])
    assert topology.gpu_nodes == (None,)
    assert [b.node for b in numa.plan_bindings(topology, [None, None, 0])] == [0, 1, 0]


def test_the_allowed_mask_limits_what_ranks_are_given(tmp_path: Path) -> None:
    root = fake_machine(tmp_path, {0: range(0, 4), 1: range(4, 8)}, 2, "0-1,8-9,4-5,12-13")
    topology = numa.read_topology(root, [])
    assert topology.nodes == {0: (0, 1, 8, 9), 1: (4, 5, 12, 13)}
    (only,) = numa.plan_bindings(topology, [None])
    assert only.cpus == (0, 1, 8, 9)


def test_more_ranks_than_cores_share_cores_and_each_still_gets_one(tmp_path: Path) -> None:
    root = fake_machine(tmp_path, {0: range(0, 2)}, 1, "0-1")
    bindings = numa.plan_bindings(numa.read_topology(root, []), [None, None, None])
    assert [b.cpus for b in bindings] == [(0,), (1,), (0,)]
    assert all(b.workers == () for b in bindings)


def test_a_single_node_machine_is_read_planned_and_left_unbound(tmp_path: Path) -> None:
    root = fake_machine(tmp_path, {0: range(0, 8)}, 2, "0-15", {"0000:3b:00.0": 0})
    topology = numa.read_topology(root, ["0000:3b:00.0"])
    (binding,) = numa.plan_bindings(topology, [0])
    assert binding.node == 0 and len(binding.workers) == 7
    before = os.sched_getaffinity(0)
    result = numa.apply_binding(binding, topology)
    assert not result.cpu_bound and result.memory_policy == "not bound (one NUMA node)"
    assert os.sched_getaffinity(0) == before


def test_a_machine_without_node_entries_is_one_node_of_its_allowed_cpus(tmp_path: Path) -> None:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/status").write_text("Cpus_allowed_list:\t0-3\n")
    topology = numa.read_topology(tmp_path, [])
    assert topology.nodes == {0: (0, 1, 2, 3)} and topology.cores == ((0,), (1,), (2,), (3,))


def test_numa_maps_resident_bytes_are_summed_per_node_with_their_page_sizes() -> None:
    text = (
        "7f0000000000 default anon=3 dirty=3 N0=2 N1=1 kernelpagesize_kB=4\n"
        "7f1000000000 prefer:1 anon=2 N1=2 kernelpagesize_kB=2048\n"
        "7f2000000000 default file=/lib/x.so\n"
    )
    assert numa.numa_map_bytes(text) == {0: 8192, 1: 4096 + 2 * 2048 * 1024}


def test_binding_for_real_pins_this_thread_and_reports_the_memory_policy_and_placement() -> None:
    # the real machine, forced (CI machines have one node): pin to the allowed set itself, a no-op
    topology = numa.read_topology("/", [])
    (binding,) = numa.plan_bindings(topology, [None])
    before = os.sched_getaffinity(0)
    try:
        result = numa.verify(numa.apply_binding(binding, topology, force=True))
        assert result.cpu_bound and os.sched_getaffinity(0) == set(binding.cpus)
        assert result.memory_policy.startswith(("preferred node", "logical only"))
        if Path("/proc/self/numa_maps").exists():
            assert sum(result.numa_maps_bytes.values()) > 0
        assert result.as_dict()["cpu_workers"] == len(binding.workers)
    finally:
        os.sched_setaffinity(0, before)


@pytest.mark.parametrize(("device", "index"), [("cuda", 0), ("cuda:3", 3), ("cpu", None), ("GPU.1", None)])
def test_device_names_give_cuda_indices(device: str, index: int | None) -> None:
    assert numa.device_index(device) == index
