"""Rollout decisions as pure functions: what the serving revision leaves free of its nodes, whether
a new plan fits there, and when the gateway's Deployment has rolled (table tests)."""

from __future__ import annotations

from typing import Any

import pytest
from fleet_fixtures import GiB, node, summary

from modelfleet.operator.placement import Placement, place, shortfall
from modelfleet.operator.rollout import free_nodes, gateway_settled, not_ready
from modelfleet.operator.spec import parse_spec

MODEL = {"uri": "pvc://models/qwen3", "servedName": "qwen3"}
GPU_NODE = {"allocatable": {"nvidia.com/gpu": "4"}}
GPU_LABELS = {"nvidia.com/gpu.memory": "8192"}  # MiB per GPU


def planned(fields: dict[str, Any], nodes: list[dict[str, Any]], layers: int = 8) -> Placement:
    result = place(parse_spec({"model": MODEL, **fields}), summary(layers), nodes, "qwen", "ai")
    assert isinstance(result, Placement), result
    return result


def allocatable(nodes: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {n["metadata"]["name"]: n["status"]["allocatable"] for n in nodes}


def test_cpu_members_leave_their_nodes_memory_less_their_stage_and_a_runtime():
    nodes = [node("a"), node("b"), node("c")]
    fields = {"parallelism": {"pipeline": 2}}
    old = planned(fields, nodes)  # 4 GiB stages on a and b
    free = allocatable(free_nodes(nodes, "qwen", old, {}, parse_spec({"model": MODEL, **fields})))
    assert free == {
        "a": {"cpu": "8", "memory": str(18 * GiB - 4 * GiB - 2 * GiB)},
        "b": {"cpu": "8", "memory": str(18 * GiB - 4 * GiB - 2 * GiB)},
        "c": {"cpu": "8", "memory": "18Gi"},
    }


@pytest.mark.parametrize(
    "count, pod_requests, gpus_left",
    [
        (1, None, "3"),  # no pod (it will be made again): the spec's count
        (2, None, "2"),
        (1, {"limits": {"nvidia.com/gpu": "3"}}, "1"),  # the live pod's own request wins
    ],
)
def test_gpu_members_take_their_devices_and_only_what_those_devices_do_not_hold(count, pod_requests, gpus_left):
    nodes = [node("a", "64Gi", labels=GPU_LABELS, **GPU_NODE)]
    fields = {"accelerator": {"profile": "nvidia-gpu", "count": count}, "parallelism": {"pipeline": 1}}
    old = planned(fields, nodes)  # 8 GiB of weights on one stage
    pods = {}
    if pod_requests is not None:
        pods[f"qwen-{old.revision}-g0-s0"] = {"spec": {"containers": [{"resources": pod_requests}]}}
    (free,) = free_nodes(nodes, "qwen", old, pods, parse_spec({"model": MODEL, **fields}))
    held = 4 - int(gpus_left)
    host = max(0, 8 * GiB - held * 8 * GiB) + 2 * GiB  # what the devices do not hold, and a runtime
    assert free["status"]["allocatable"] == {"cpu": "8", "memory": str(64 * GiB - host), "nvidia.com/gpu": gpus_left}


def test_a_plan_fits_free_nodes_or_names_the_stage_node_and_shortfall():
    fields = {"parallelism": {"pipeline": 2}}
    the_spec = parse_spec({"model": MODEL, **fields})
    new = planned(fields, [node("a"), node("b")])
    assert shortfall(new, the_spec, [node("a"), node("b")]) is None
    assert shortfall(new, the_spec, [node("a")]) == "node b is gone"
    short = shortfall(new, the_spec, [node("a", "5Gi"), node("b")])
    assert short == f"a (group 0, stage 0) needs {4 * GiB} bytes, has {3 * GiB}, short by {GiB} bytes"
    gpu = parse_spec({"model": MODEL, "accelerator": {"profile": "nvidia-gpu"}, **fields})
    gpu_plan = planned({"accelerator": {"profile": "nvidia-gpu"}, **fields}, [node(n, **GPU_NODE) for n in "ab"])
    no_gpus = [node("a", allocatable={"nvidia.com/gpu": "0"}), node("b", **GPU_NODE)]
    assert "a: allocatable nvidia.com/gpu below 1" in str(shortfall(gpu_plan, gpu, no_gpus))


@pytest.mark.parametrize(
    "metadata, spec, status, settled",
    [
        ({"generation": 3}, {"replicas": 2}, {"observedGeneration": 3, "replicas": 2, "updatedReplicas": 2, "availableReplicas": 2}, True),
        ({"generation": 3}, {"replicas": 2}, {"observedGeneration": 2, "replicas": 2, "updatedReplicas": 2, "availableReplicas": 2}, False),
        ({"generation": 3}, {"replicas": 2}, {"observedGeneration": 3, "replicas": 3, "updatedReplicas": 2, "availableReplicas": 2}, False),
        ({"generation": 3}, {"replicas": 2}, {"observedGeneration": 3, "replicas": 2, "updatedReplicas": 1, "availableReplicas": 2}, False),
        ({"generation": 3}, {"replicas": 2}, {"observedGeneration": 3, "replicas": 2, "updatedReplicas": 2, "availableReplicas": 1}, False),
        ({"generation": 1}, {"replicas": 1}, {}, False),
    ],
)  # fmt: skip
def test_the_gateway_has_rolled_when_every_pod_runs_the_current_template_as_kubectl_rollout_status_says(
    metadata, spec, status, settled
):
    assert gateway_settled({"metadata": metadata, "spec": spec, "status": status}) is settled
    assert gateway_settled(None) is False


@pytest.mark.parametrize(
    "phase, pod, says",
    [
        ("Ready", {"status": {"phase": "Running"}}, None),
        ("Pending", None, "p (Pending: no pod)"),
        ("Pending", {"status": {"phase": "Pending"}}, "p (Pending)"),
        ("Pending", {"status": {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 nodes"}]}}, "p (Pending: Unschedulable 0/3 nodes)"),
        ("Pending", {"status": {"containerStatuses": [{"name": "agent", "state": {"waiting": {"reason": "ImagePullBackOff"}}}]}}, "p (Pending: container agent ImagePullBackOff)"),
        ("Pending", {"status": {"initContainerStatuses": [{"name": "fetch", "state": {"running": {}}}], "reason": "Evicted"}}, "p (Pending: Evicted)"),
        ("Loading", {"status": {"phase": "Running"}}, "p (Loading)"),
    ],
)  # fmt: skip
def test_members_not_ready_are_named_with_their_phase_and_what_their_pod_says(phase, pod, says):
    pods = {} if pod is None else {"p": pod}
    assert not_ready([{"pod": "p", "phase": phase}], pods) == ([says] if says else [])
