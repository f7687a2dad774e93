"""Placement: which nodes match a fleet, and how its layers are laid over them (table tests)."""

from __future__ import annotations

import pytest
from fleet_fixtures import GiB, node, summary

from modelfleet.operator.placement import Infeasible, Placement, place, rejection
from modelfleet.operator.spec import parse_spec

MODEL = {"uri": "pvc://models/qwen3", "servedName": "qwen3"}


def spec(**fields):
    return parse_spec({"model": MODEL, **fields})


def layout(result):
    assert isinstance(result, Placement), getattr(result, "message", result)
    return [[(s.layer_start, s.layer_end) for s in g.stages] for g in result.plan.groups]


def nodes_of(result):
    return [(m.group, m.stage, m.tp_rank, m.node) for m in result.members]


# ---- matching ---------------------------------------------------------------------------------

GPU = {"allocatable": {"nvidia.com/gpu": "2"}}
IGPU = {"allocatable": {"gpu.intel.com/xe": "1"}}


@pytest.mark.parametrize(
    "fields, the_node, why",
    [
        ({}, node("a"), None),
        ({"placement": {"nodeSelector": {"pool": "ai"}}}, node("a", labels={"pool": "ai"}), None),
        ({"placement": {"nodeSelector": {"pool": "ai"}}}, node("a", labels={"pool": "web"}), "label pool=ai missing"),
        ({}, node("a", unschedulable=True), "unschedulable"),
        ({}, node("a", ready=False), "not Ready"),
        ({}, node("a", taints=[{"key": "gpu", "value": "x", "effect": "NoSchedule"}]), "taint gpu=x:NoSchedule not tolerated"),
        ({}, node("a", taints=[{"key": "gpu", "effect": "PreferNoSchedule"}]), None),
        ({"placement": {"tolerations": [{"key": "gpu", "operator": "Exists"}]}}, node("a", taints=[{"key": "gpu", "effect": "NoExecute"}]), None),
        ({"placement": {"tolerations": [{"key": "gpu", "value": "y"}]}}, node("a", taints=[{"key": "gpu", "value": "x", "effect": "NoSchedule"}]), "not tolerated"),
        ({"placement": {"tolerations": [{"operator": "Exists"}]}}, node("a", taints=[{"key": "any", "effect": "NoSchedule"}]), None),
        ({"resources": {"memory": "16Gi", "cpu": "8"}}, node("a", "16Gi"), None),
        ({"resources": {"memory": "20Gi"}}, node("a", "16Gi"), "allocatable memory 16Gi below resources.memory=20Gi"),
        ({"resources": {"cpu": "9"}}, node("a"), "allocatable cpu 8 below resources.cpu=9"),
        ({"accelerator": {"profile": "nvidia-gpu"}}, node("a", **GPU), None),
        ({"accelerator": {"profile": "nvidia-gpu", "count": 4}}, node("a", **GPU), "allocatable nvidia.com/gpu below 4"),
        ({"accelerator": {"profile": "nvidia-gpu"}}, node("a"), "allocatable nvidia.com/gpu below 1"),
        ({"backend": "openvino", "accelerator": {"profile": "intel-igpu"}}, node("a", **IGPU), None),
        ({"backend": "openvino", "accelerator": {"profile": "intel-igpu"}}, node("a", **GPU), "gpu.intel.com/i915 or gpu.intel.com/xe"),
    ],
)  # fmt: skip
def test_a_node_matches_when_it_has_the_labels_tolerations_and_accelerator(fields, the_node, why):
    found = rejection(the_node, spec(**fields))
    if why is None:
        assert found is None
    else:
        assert found is not None and why in found


# ---- layer ranges -----------------------------------------------------------------------------


def test_equal_nodes_get_equal_layer_ranges_and_auto_pipeline_uses_every_node():
    result = place(spec(), summary(8), [node(n) for n in "dcba"], "qwen", "ai")
    assert layout(result) == [[(0, 2), (2, 4), (4, 6), (6, 8)]]
    assert nodes_of(result) == [(0, 0, 0, "a"), (0, 1, 0, "b"), (0, 2, 0, "c"), (0, 3, 0, "d")]


def test_unequal_nodes_get_layers_in_proportion_to_usable_memory():
    # usable = allocatable - 2 GiB runtime reserve: 32 GiB and 16 GiB
    result = place(spec(), summary(12), [node("big", "34Gi"), node("small", "18Gi")], "qwen", "ai")
    assert layout(result) == [[(0, 8), (8, 12)]]


def test_a_fixed_pipeline_takes_the_nodes_with_the_most_memory():
    nodes = [node("a", "10Gi"), node("b", "40Gi"), node("c", "40Gi")]
    result = place(spec(parallelism={"pipeline": 2}), summary(8), nodes, "qwen", "ai")
    assert [m.node for m in result.members] == ["b", "c"]


def test_tensor_parallel_groups_deal_nodes_group_by_group_stage_by_stage_rank_by_rank():
    nodes = [node(f"n{k}") for k in range(8)]
    result = place(spec(parallelism={"pipeline": 2, "tensor": 2}, replicas=2), summary(8), nodes, "f", "ns")
    assert layout(result) == [[(0, 4), (4, 8)]] * 2
    assert nodes_of(result)[:4] == [(0, 0, 0, "n0"), (0, 0, 1, "n1"), (0, 1, 0, "n2"), (0, 1, 1, "n3")]
    assert result.plan.groups[1].stages[1].tp_size == 2
    assert result.plan.groups[1].stages[1].address == f"f-{result.revision}-g1-s1-r0.f-stages.ns.svc:5555"


def test_listed_stages_are_kept_as_given():
    stages = [{"layerStart": 0, "layerEnd": 1}, {"layerStart": 1, "layerEnd": 8}]
    result = place(spec(stages=stages), summary(8), [node("a"), node("b")], "qwen", "ai")
    assert layout(result) == [[(0, 1), (1, 8)]]


def test_the_plan_carries_devices_sizes_serving_limits_and_headless_addresses():
    gpu = {"allocatable": {"nvidia.com/gpu": "1"}}
    the_spec = spec(
        accelerator={"profile": "nvidia-gpu"}, serving={"maxStreams": 4, "contextLength": 100}, gateway={"maxQueue": 3}
    )
    result = place(the_spec, summary(4, kv_per_position=10), [node("a", **gpu), node("b", **gpu)], "qwen", "ai")
    first = result.plan.stage(0, 0)
    assert (first.device, first.weights_bytes, first.kv_budget_bytes) == ("cuda", 2 * GiB, 2 * 4 * 100 * 10)
    assert first.address == f"qwen-{result.revision}-g0-s0.qwen-stages.ai.svc:5555"
    assert (result.plan.serving.max_streams, result.plan.serving.max_queue) == (4, 3)
    assert result.members[0].accelerator_resource == "nvidia.com/gpu"


# ---- infeasible -------------------------------------------------------------------------------


def test_no_matching_nodes_names_every_node_and_why():
    result = place(spec(accelerator={"profile": "nvidia-gpu"}), summary(8), [node("a"), node("b")], "qwen", "ai")
    assert isinstance(result, Infeasible) and result.reason == "NoMatchingNodes"
    assert result.nodes_considered == ("a", "b")
    assert "a: allocatable nvidia.com/gpu below 1" in result.message and "b: " in result.message


def test_insufficient_capacity_names_the_shortfall_in_bytes():
    # 4 layers of 10 GiB on two nodes offering 10 GiB each: 20 GiB missing
    result = place(spec(), summary(4, layer_gib=10), [node("a", "12Gi"), node("b", "12Gi")], "qwen", "ai")
    assert isinstance(result, Infeasible) and result.reason == "InsufficientCapacity"
    assert result.missing_bytes == 20 * GiB
    assert f"{20 * GiB} bytes (20.00 GiB) missing" in result.message
    assert "a (stage 0, layers [0, 2)) needs" in result.message
    assert result.nodes_considered == ("a", "b")


def test_too_few_matching_nodes_for_a_fixed_pipeline_is_insufficient_capacity_naming_the_others():
    nodes = [node("a"), node("b"), node("c", unschedulable=True)]
    result = place(spec(parallelism={"pipeline": 3}), summary(8), nodes, "qwen", "ai")
    assert isinstance(result, Infeasible) and result.reason == "InsufficientCapacity"
    assert "needs 3 matching nodes" in result.message and "2 match: a, b" in result.message
    assert "not matching: c: unschedulable" in result.message


def test_a_listed_stage_larger_than_its_node_is_insufficient_capacity():
    stages = [{"layerStart": 0, "layerEnd": 7}, {"layerStart": 7, "layerEnd": 8}]
    result = place(spec(stages=stages), summary(8, layer_gib=3), [node("a"), node("b")], "qwen", "ai")
    assert isinstance(result, Infeasible) and result.reason == "InsufficientCapacity"
    assert result.missing_bytes == 5 * GiB and "a (stage 0, layers [0, 7)) needs" in result.message


def test_more_stages_than_layers_is_invalid_for_the_model():
    result = place(spec(parallelism={"pipeline": 3}), summary(2), [node(n) for n in "abc"], "qwen", "ai")
    assert isinstance(result, Infeasible) and result.reason == "InvalidForModel"


def test_the_revision_follows_the_plan_and_the_nodes_and_every_address_names_it():
    nodes = [node("a"), node("b"), node("c")]
    base = place(spec(parallelism={"pipeline": 2}), summary(8), nodes, "qwen", "ai")
    again = place(spec(parallelism={"pipeline": 2}), summary(8), nodes, "qwen", "ai")
    streams = place(spec(parallelism={"pipeline": 2}, serving={"maxStreams": 8}), summary(8), nodes, "qwen", "ai")
    moved = place(spec(parallelism={"pipeline": 2}), summary(8), [node("a"), node("c")], "qwen", "ai")
    gateway = place(spec(parallelism={"pipeline": 2}, gateway={"replicas": 3}), summary(8), nodes, "qwen", "ai")
    assert base.revision == again.revision == gateway.revision  # the gateway's replicas are not in the plan
    assert len({base.revision, streams.revision, moved.revision}) == 3  # moved: same layers, other nodes
    for result in (base, streams, moved):
        assert len(result.revision) == 10
        assert all(f"qwen-{result.revision}-g0-s" in stage.address for stage in result.plan.groups[0].stages)
