"""Placement: which nodes match a fleet, and how its layers are laid over them (table tests)."""

from __future__ import annotations

import pytest
from fleet_fixtures import GiB, node, summary

from modelfleet.operator.affinity import member_labels, pod_terms
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


# ---- required node affinity -------------------------------------------------------------------


def required(*terms):
    return {
        "placement": {
            "affinity": {
                "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": list(terms)}}
            }
        }
    }


def expr(key, operator, *values):
    return {"key": key, "operator": operator, **({"values": list(values)} if values else {})}


A100 = {"gpu": "a100", "gpus": "8"}


@pytest.mark.parametrize(
    "terms, labels, why",
    [
        ([{"matchExpressions": [expr("gpu", "In", "a100", "h100")]}], A100, None),
        ([{"matchExpressions": [expr("gpu", "In", "h100")]}], A100, "term 0: label gpu In ['h100'] not met"),
        ([{"matchExpressions": [expr("gpu", "In", "a100")]}], {}, "gpu In ['a100'] not met"),
        ([{"matchExpressions": [expr("gpu", "NotIn", "h100")]}], A100, None),
        ([{"matchExpressions": [expr("gpu", "NotIn", "h100")]}], {}, None),
        ([{"matchExpressions": [expr("gpu", "NotIn", "a100")]}], A100, "gpu NotIn ['a100'] not met"),
        ([{"matchExpressions": [expr("gpu", "Exists")]}], A100, None),
        ([{"matchExpressions": [expr("gpu", "Exists")]}], {}, "gpu Exists not met"),
        ([{"matchExpressions": [expr("spot", "DoesNotExist")]}], A100, None),
        ([{"matchExpressions": [expr("gpu", "DoesNotExist")]}], A100, "gpu DoesNotExist not met"),
        ([{"matchExpressions": [expr("gpus", "Gt", "4")]}], A100, None),
        ([{"matchExpressions": [expr("gpus", "Gt", "8")]}], A100, "gpus Gt ['8'] not met"),
        ([{"matchExpressions": [expr("gpus", "Lt", "9")]}], A100, None),
        ([{"matchExpressions": [expr("gpus", "Lt", "8")]}], A100, "gpus Lt ['8'] not met"),
        ([{"matchExpressions": [expr("gpu", "Gt", "1")]}], A100, "gpu Gt ['1'] not met"),  # not an integer
        ([{"matchExpressions": [expr("gpus", "Gt", "1")]}], {}, "gpus Gt ['1'] not met"),
        ([{"matchExpressions": [expr("gpu", "Exists"), expr("gpus", "Gt", "8")]}], A100, "gpus Gt ['8'] not met"),  # ANDed
        ([{"matchExpressions": [expr("gpu", "In", "h100")]}, {"matchExpressions": [expr("gpus", "Gt", "4")]}], A100, None),  # ORed
        ([{"matchExpressions": [expr("gpu", "In", "h100")]}, {"matchExpressions": [expr("x", "Exists")]}], A100, "term 0: label gpu In ['h100'] not met; term 1: label x Exists not met"),
        ([{"matchFields": [expr("metadata.name", "In", "a", "b")]}], {}, None),
        ([{"matchFields": [expr("metadata.name", "NotIn", "a")]}], {}, "field metadata.name NotIn ['a'] not met"),
        ([{"matchExpressions": [expr("gpu", "Exists")], "matchFields": [expr("metadata.name", "In", "b")]}], A100, "field metadata.name In ['b'] not met"),
        ([{"matchExpressions": [expr("gpu", "Near", "a100")]}], A100, "unknown operator"),
        ([{}], A100, "empty term matches no node"),
        ([], A100, "nodeSelectorTerms is empty"),
    ],
)  # fmt: skip
def test_required_node_affinity_ors_terms_and_ands_requirements_on_labels_and_the_node_name(terms, labels, why):
    found = rejection(node("a", labels=labels), spec(**required(*terms)))
    if why is None:
        assert found is None
    else:
        assert found is not None and found.startswith("placement.affinity") and why in found


def test_preferred_node_affinity_alone_rejects_no_node():
    preferred = [{"weight": 1, "preference": {"matchExpressions": [expr("gpu", "In", "h100")]}}]
    affinity = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": preferred}}
    assert rejection(node("a", labels=A100), spec(placement={"affinity": affinity})) is None


def test_nodes_outside_the_required_affinity_are_not_used_and_are_named_with_the_reason():
    terms = {"matchExpressions": [expr("pool", "In", "ai")]}
    nodes = [node("a", labels={"pool": "ai"}), node("b", labels={"pool": "web"}), node("c", labels={"pool": "ai"})]
    result = place(spec(**required(terms)), summary(8), nodes, "qwen", "ai")
    assert [m.node for m in result.members] == ["a", "c"]
    none = place(spec(**required(terms)), summary(8), [nodes[1]], "qwen", "ai")
    assert isinstance(none, Infeasible) and none.reason == "NoMatchingNodes" and none.nodes_considered == ("b",)
    assert none.rejected == {
        "b": "placement.affinity: no required nodeSelectorTerm matches (term 0: label pool In ['ai'] not met)"
    }


# ---- tensor ranks sharing a node --------------------------------------------------------------


def gpus(count, gpu_mib=0):
    labels = {"nvidia.com/gpu.memory": str(gpu_mib)} if gpu_mib else {}
    return {"labels": labels, "allocatable": {"nvidia.com/gpu": str(count)}}


def gpu_node(name, count, memory="18Gi", gpu_mib=0):
    extra = gpus(count, gpu_mib)
    return node(name, memory, labels=extra["labels"], allocatable=extra["allocatable"])


@pytest.mark.parametrize(
    "fields, nodes, members",
    [
        # four ranks of one stage on the one node with four GPUs
        ({"parallelism": {"tensor": 4}}, [gpu_node("box", 4)], [(0, 0, r, "box") for r in range(4)]),
        # two stages of two ranks: a node per stage, the ranks of a stage together
        ({"parallelism": {"pipeline": 2, "tensor": 2}}, [gpu_node("a", 2), gpu_node("b", 2)],
         [(0, 0, 0, "a"), (0, 0, 1, "a"), (0, 1, 0, "b"), (0, 1, 1, "b")]),
        # a node with too few GPUs for a stage is left out when another holds one
        ({"parallelism": {"tensor": 2}}, [gpu_node("one", 1), gpu_node("two", 2)], [(0, 0, 0, "two"), (0, 0, 1, "two")]),
        # tensor x count devices: two ranks of two GPUs need four
        ({"parallelism": {"tensor": 2}, "accelerator": {"profile": "nvidia-gpu", "count": 2}},
         [gpu_node("two", 2), gpu_node("four", 4)], [(0, 0, 0, "four"), (0, 0, 1, "four")]),
        # no node holds a stage: ranks on separate nodes, as before
        ({"parallelism": {"tensor": 2}}, [gpu_node("a", 1), gpu_node("b", 1)], [(0, 0, 0, "a"), (0, 0, 1, "b")]),
        # two groups: a node each
        ({"parallelism": {"tensor": 2}, "replicas": 2}, [gpu_node("a", 2), gpu_node("b", 2)],
         [(0, 0, 0, "a"), (0, 0, 1, "a"), (1, 0, 0, "b"), (1, 0, 1, "b")]),
    ],
)  # fmt: skip
def test_a_stage_s_tensor_ranks_share_one_node_that_offers_their_devices(fields, nodes, members):
    the_spec = spec(**{"accelerator": {"profile": "nvidia-gpu"}, **fields})
    result = place(the_spec, summary(8), nodes, "f", "ns")
    assert isinstance(result, Placement), getattr(result, "message", result)
    assert nodes_of(result) == members
    assert all(m.accelerator_resource == "nvidia.com/gpu" for m in result.members)


def test_cpu_tensor_ranks_keep_a_node_each():
    result = place(spec(parallelism={"tensor": 2}), summary(8), [node("a"), node("b")], "f", "ns")
    assert nodes_of(result) == [(0, 0, 0, "a"), (0, 0, 1, "b")]


def test_a_packed_stage_offers_its_node_s_host_memory_plus_the_memory_of_its_tensor_gpus():
    # 8 GPUs of 10 GiB, 2 of them per stage: 34 - 2 + 2 x 10 = 52 GiB per stage, 26 GiB short of 78
    box = gpu_node("box", 8, "34Gi", gpu_mib=10 * 1024)
    result = place(
        spec(accelerator={"profile": "nvidia-gpu"}, parallelism={"tensor": 2}), summary(78), [box], "f", "ns"
    )
    assert isinstance(result, Infeasible) and result.reason == "InsufficientCapacity"
    assert result.missing_bytes == 26 * GiB and "box (stage 0, layers [0, 78)) needs" in result.message
    fits = place(spec(accelerator={"profile": "nvidia-gpu"}, parallelism={"tensor": 2}), summary(52), [box], "f", "ns")
    assert layout(fits) == [[(0, 52)]] and fits.plan.groups[0].stages[0].tp_size == 2


def test_a_packed_stage_needs_its_tensor_pods_resources_on_one_node():
    fields = {"accelerator": {"profile": "nvidia-gpu"}, "parallelism": {"tensor": 2}, "resources": {"cpu": "4"}}
    nodes = [
        node("small", allocatable={"cpu": "7", "nvidia.com/gpu": "2"}),
        node("big", allocatable={"cpu": "9", "nvidia.com/gpu": "2"}),
    ]
    result = place(spec(**fields), summary(8), nodes, "f", "ns")
    assert nodes_of(result) == [(0, 0, 0, "big"), (0, 0, 1, "big")]
    tight = place(spec(**{**fields, "resources": {"cpu": "5"}}), summary(8), nodes, "f", "ns")
    assert nodes_of(tight) == [(0, 0, 0, "big"), (0, 0, 1, "small")]  # no node holds a stage: one rank each


def test_too_few_nodes_for_packed_stages_names_the_nodes_with_too_few_devices():
    the_spec = spec(accelerator={"profile": "nvidia-gpu"}, parallelism={"pipeline": 2, "tensor": 4})
    result = place(the_spec, summary(8), [gpu_node("box", 4), gpu_node("small", 2)], "f", "ns")
    assert isinstance(result, Infeasible) and result.reason == "InsufficientCapacity"
    assert "needs 2 matching nodes (2 stages x 4 ranks on one node x 1 groups), 1 match: box" in result.message
    assert result.rejected == {
        "small": "allocatable nvidia.com/gpu 2 below parallelism.tensor x accelerator.count = 4 (a stage's ranks share one node)"
    }
    assert result.nodes_considered == ("box", "small")


# ---- preferred node affinity ------------------------------------------------------------------


def preferring(*weighted):
    """placement.affinity with preferred node-affinity terms: (weight, [requirements]) each."""
    terms = [{"weight": w, "preference": {"matchExpressions": list(r)}} for w, r in weighted]
    return {"affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": terms}}}


ZONES = [node("a", labels={"zone": "z1"}), node("b", labels={"zone": "z2", "disk": "ssd"}), node("c", labels={"zone": "z3", "disk": "ssd"})]  # fmt: skip


@pytest.mark.parametrize(
    "preferences, nodes, chosen",
    [
        ((), ZONES, ["a", "b"]),  # no preference: the most memory, then the name, as before
        (((10, [expr("zone", "In", "z3")]),), ZONES, ["a", "c"]),  # c first, then the tie by name
        (((5, [expr("disk", "In", "ssd")]), (5, [expr("zone", "In", "z2")])), ZONES, ["b", "c"]),  # weights add
        (((5, [expr("disk", "In", "ssd")]), (20, [expr("zone", "In", "z1")])), ZONES, ["a", "b"]),  # a: 20, b and c: 5
        (((10, [expr("zone", "In", "z3")]),), [node("a", "30Gi"), node("b", "30Gi"), node("c", "18Gi", labels={"zone": "z3"})], ["a", "c"]),  # over memory
        (((10, []),), ZONES, ["a", "b"]),  # an empty preference is a no-op
        (((10, [expr("zone", "In", "z9")]),), ZONES, ["a", "b"]),  # matching no node changes nothing
    ],
)  # fmt: skip
def test_preferred_node_affinity_orders_the_candidate_nodes_by_the_weights_they_match(preferences, nodes, chosen):
    fields = {"parallelism": {"pipeline": 2}, "placement": preferring(*preferences)}
    result = place(spec(**fields), summary(8), nodes, "qwen", "ai")
    assert [m.node for m in result.members] == chosen  # dealt by name, as before


def test_preferred_node_affinity_never_admits_a_node_the_required_terms_reject():
    affinity = {
        **preferring((100, [expr("zone", "In", "z1")]))["affinity"],
        **required({"matchExpressions": [expr("disk", "Exists")]})["placement"]["affinity"],
    }
    result = place(spec(parallelism={"pipeline": 1}, placement={"affinity": affinity}), summary(8), ZONES, "qwen", "ai")
    assert [m.node for m in result.members] == ["b"]


# ---- pod affinity among the fleet's members ---------------------------------------------------


def pod_term(selector, topology="kubernetes.io/hostname", **extra):
    return {"labelSelector": selector, "topologyKey": topology, **extra}


def pods(kind, *terms, preferred=()):
    section = {"requiredDuringSchedulingIgnoredDuringExecution": list(terms)}
    if preferred:
        section["preferredDuringSchedulingIgnoredDuringExecution"] = list(preferred)
    return {"affinity": {kind: section}}


SAME_FLEET = {"matchLabels": {"modelfleet.io/fleet": "qwen"}}
TP2 = {"accelerator": {"profile": "nvidia-gpu"}, "parallelism": {"tensor": 2, "pipeline": 1}}
TWO_BOXES = [gpu_node("a", 2), gpu_node("b", 2)]


@pytest.mark.parametrize(
    "placement, members",
    [
        ({}, [(0, 0, 0, "a"), (0, 0, 1, "a")]),  # packed, as before
        (pods("podAntiAffinity", pod_term(SAME_FLEET)), [(0, 0, 0, "a"), (0, 0, 1, "b")]),  # one member per node
        (pods("podAntiAffinity", pod_term({"matchExpressions": [expr("modelfleet.io/fleet", "In", "qwen")]})), [(0, 0, 0, "a"), (0, 0, 1, "b")]),
        (pods("podAntiAffinity", pod_term({"matchLabels": {"modelfleet.io/component": "stage"}})), [(0, 0, 0, "a"), (0, 0, 1, "b")]),  # also other fleets'
        (pods("podAntiAffinity", pod_term({"matchLabels": {"modelfleet.io/tp-rank": "1"}})), [(0, 0, 0, "a"), (0, 0, 1, "b")]),  # rank 1 repels rank 0
        (pods("podAntiAffinity", pod_term({"matchLabels": {"modelfleet.io/fleet": "other"}})), [(0, 0, 0, "a"), (0, 0, 1, "a")]),  # selects no member
        (pods("podAntiAffinity", pod_term(SAME_FLEET, "topology.kubernetes.io/zone")), [(0, 0, 0, "a"), (0, 0, 1, "a")]),  # left to the scheduler
        (pods("podAntiAffinity", {"topologyKey": "kubernetes.io/hostname"}), [(0, 0, 0, "a"), (0, 0, 1, "a")]),  # a null selector selects nothing
    ],
)  # fmt: skip
def test_required_pod_anti_affinity_on_the_hostname_keeps_the_members_it_selects_on_nodes_of_their_own(
    placement, members
):
    result = place(spec(**TP2, placement=placement), summary(8), TWO_BOXES, "qwen", "ai")
    assert isinstance(result, Placement), getattr(result, "message", result)
    assert nodes_of(result) == members


def test_anti_affinity_without_a_node_per_rank_is_insufficient_capacity_naming_the_term():
    placement = pods("podAntiAffinity", pod_term(SAME_FLEET))
    result = place(spec(**TP2, placement=placement), summary(8), [gpu_node("a", 2)], "qwen", "ai")
    assert isinstance(result, Infeasible) and result.reason == "InsufficientCapacity"
    assert (
        "placement.affinity.podAntiAffinity required term 0 keeps a stage's ranks on nodes of their own"
        in result.message
    )


@pytest.mark.parametrize(
    "fields, nodes, why",
    [
        ({"parallelism": {"pipeline": 1}}, [node("a")], None),  # the whole fleet on one node
        ({"parallelism": {"pipeline": 2}}, [node("a"), node("b")], "needs every member on one node, beside a member it selects; the plan puts them on a, b"),
        ({"parallelism": {"pipeline": 1}, "replicas": 2}, [node("a"), node("b")], "the plan puts them on a, b"),
    ],
)  # fmt: skip
def test_required_pod_affinity_within_the_fleet_needs_the_whole_fleet_on_one_node(fields, nodes, why):
    result = place(spec(**fields, placement=pods("podAffinity", pod_term(SAME_FLEET))), summary(8), nodes, "qwen", "ai")
    if why is None:
        assert isinstance(result, Placement), getattr(result, "message", result)
    else:
        assert isinstance(result, Infeasible) and result.reason == "InsufficientCapacity"
        assert result.message.startswith("placement.affinity.podAffinity required term 0 (kubernetes.io/hostname)")
        assert why in result.message


def test_pod_affinity_within_the_fleet_that_selects_no_member_can_schedule_no_pod():
    selector = {"matchLabels": {"modelfleet.io/fleet": "qwen", "modelfleet.io/component": "gateway"}}
    result = place(spec(placement=pods("podAffinity", pod_term(selector))), summary(8), [node("a")], "qwen", "ai")
    assert isinstance(result, Infeasible) and "selects no member of fleet qwen" in result.message


@pytest.mark.parametrize(
    "placement, notes",
    [
        ({}, []),
        (pods("podAntiAffinity", pod_term(SAME_FLEET)), []),
        (pods("podAntiAffinity", pod_term(SAME_FLEET, namespaces=["ai"])), []),
        (pods("podAntiAffinity", pod_term(SAME_FLEET, "topology.kubernetes.io/zone")),
         ["placement.affinity.podAntiAffinity required term 0 (topologyKey topology.kubernetes.io/zone) is left to the scheduler: the planner evaluates kubernetes.io/hostname only"]),
        (pods("podAntiAffinity", pod_term({"matchLabels": {"app": "db"}})),
         ["placement.affinity.podAntiAffinity required term 0 is evaluated among fleet qwen's members; the scheduler checks the other pods it selects"]),
        (pods("podAntiAffinity", pod_term(SAME_FLEET, namespaceSelector={})),
         ["placement.affinity.podAntiAffinity required term 0 is evaluated among fleet qwen's members; the scheduler checks the other pods it selects"]),
        (pods("podAffinity", pod_term({"matchLabels": {"app": "cache"}})),
         ["placement.affinity.podAffinity required term 0 selects pods outside fleet qwen: the scheduler checks it on each planned node"]),
        (pods("podAffinity", preferred=[{"weight": 1, "podAffinityTerm": pod_term(SAME_FLEET)}]),
         ["placement.affinity.podAffinity preferred terms are left to the scheduler (each stage pod is bound to its planned node)"]),
    ],
)  # fmt: skip
def test_the_planner_names_each_pod_affinity_term_it_leaves_to_the_scheduler(placement, notes):
    assert pod_terms(placement.get("affinity"), "qwen", "ai")[1] == notes


def test_pod_affinity_to_pods_outside_the_fleet_does_not_constrain_the_plan():
    placement = pods("podAffinity", pod_term({"matchLabels": {"app": "cache"}}))
    result = place(
        spec(parallelism={"pipeline": 2}, placement=placement), summary(8), [node("a"), node("b")], "qwen", "ai"
    )
    assert [m.node for m in result.members] == ["a", "b"]


def test_the_selector_labels_are_the_stage_pods_own():
    from modelfleet.operator import objects

    the_spec = spec(**TP2)
    result = place(the_spec, summary(8), TWO_BOXES, "qwen", "ai")
    body = {"metadata": {"name": "qwen", "namespace": "ai", "uid": "u"}}
    for member in result.members:
        pod = objects.stage_pod(body, the_spec, result, member)
        labels = member_labels("qwen", member.group, member.stage, member.tp_rank)
        assert labels.items() <= pod["metadata"]["labels"].items()
