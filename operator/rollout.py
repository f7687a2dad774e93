"""Rollouts with a surge, as pure decisions: a new revision runs beside the serving one until its
chain is ready, then the gateway moves to it, then the old revision goes.

The *serving* revision is the one the gateway's pod template names (``modelfleet.io/revision``);
the *target* is the plan of the fleet's current generation. A rollout is under way while they
differ. Its steps, one reconcile pass at a time:

1. the target's plan and pods are created beside the serving revision's (``Surge``), on what the
   serving members leave free of their nodes (:func:`free_nodes`);
2. once every target member is Ready, the gateway's template is switched to the target (the
   Deployment rolls its pods; the old ones keep serving the old chain until new ones are ready);
3. once every gateway pod runs the new template (:func:`gateway_settled`), the old revision's pods
   and plan are deleted.

When the target does not fit beside the serving revision it *replaces* it (``Replace``: the old
pods go in the pass that creates the new ones, and the fleet does not serve until they load). When
a target member fails past ``restartPolicy.maxStageRestarts``, when the target is not ready
``rollout.progressDeadlineSeconds`` after its surge began (:func:`overdue`), or when no new plan
fits at all, the rollout stops (``Failed``) and the serving revision keeps serving until the next
generation. The surge's start is kept in the fleet's status (``rolloutStartedAt``), never in the
operator's memory, so a restarted operator keeps the deadline.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any

from modelfleet.planner import RUNTIME_RESERVE_BYTES, node_name, parse_quantity

from . import names
from .affinity import member_labels, pod_terms, selects
from .placement import Placement
from .spec import ModelFleetSpec
from .status import parse_timestamp

Obj = Mapping[str, Any]


class Step(StrEnum):
    STEADY = "Steady"  # the gateway serves the target (or nothing serves yet)
    SURGE = "Surge"  # the target runs beside the serving revision
    REPLACE = "Replace"  # the target replaces the serving revision at once: no room for both
    FAILED = "Failed"  # the target failed: the serving revision stays, the target's pods go


def serving_revision(gateway: Obj | None) -> str | None:
    """The revision the gateway Deployment's pod template points at (None before there is one)."""
    template = ((gateway or {}).get("spec") or {}).get("template") or {}
    return ((template.get("metadata") or {}).get("annotations") or {}).get(names.ANNOTATION_REVISION)


def gateway_settled(gateway: Obj | None) -> bool:
    """Every gateway pod runs the Deployment's current template and is available: the test of
    ``kubectl rollout status`` (the controller has seen this generation; no old pods are left)."""
    if not gateway:
        return False
    status, spec = gateway.get("status") or {}, gateway.get("spec") or {}
    generation = int((gateway.get("metadata") or {}).get("generation") or 0)
    updated, wanted = int(status.get("updatedReplicas") or 0), int(spec.get("replicas", 1))
    return (
        int(status.get("observedGeneration") or 0) >= generation
        and updated >= wanted
        and int(status.get("replicas") or 0) <= updated
        and int(status.get("availableReplicas") or 0) >= updated
    )


def free_nodes(
    nodes: Sequence[Obj], fleet: str, serving: Placement, pods: Mapping[str, Obj], spec: ModelFleetSpec
) -> list[dict[str, Any]]:
    """The nodes as a second revision finds them while ``serving``'s members run: from each
    member's node, the devices and cpu its pod requests (the spec's when the pod is gone: it will
    be made again), and host memory for its share of the stage's weights and KV cache beyond what
    its devices hold, plus a runtime (or its memory request, if larger)."""
    used: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for member in serving.members:
        stage = serving.plan.stage(member.group, member.stage)
        name = names.pod_name(fleet, serving.revision, member.group, member.stage, member.tp_rank, stage.tp_size)
        requests = _requests(pods.get(name))
        resource = member.accelerator_resource
        devices = requests.get(resource, spec.accelerator.devices_per_pod) if resource else 0
        on_devices = devices * _gpu_bytes(nodes, member.node) if resource == "nvidia.com/gpu" else 0
        share = (stage.weights_bytes + stage.kv_budget_bytes) // stage.tp_size
        host = max(requests.get("memory", 0), max(0, share - on_devices) + RUNTIME_RESERVE_BYTES)
        on_node = used[member.node]
        for key, amount in ((resource or "", devices), ("memory", host), ("cpu", requests.get("cpu", 0))):
            if key:
                on_node[key] += amount
    return [_less(node, used.get(node_name(node), {})) for node in nodes]


def _requests(pod: Obj | None) -> dict[str, int]:
    """What a pod's containers request (limits stand for requests where only they are given)."""
    total: dict[str, int] = defaultdict(int)
    for container in ((pod or {}).get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        for key, value in {**(resources.get("limits") or {}), **(resources.get("requests") or {})}.items():
            total[key] += parse_quantity(value)
    return dict(total)


def _gpu_bytes(nodes: Sequence[Obj], name: str) -> int:
    """One GPU's memory on node ``name`` (GPU feature discovery's label, MiB), 0 when unknown."""
    node = next((n for n in nodes if node_name(n) == name), {})
    labels = (node.get("metadata") or {}).get("labels") or {}
    return parse_quantity(labels.get("nvidia.com/gpu.memory", 0)) * 2**20


def _less(node: Obj, used: Mapping[str, int]) -> dict[str, Any]:
    if not used:
        return dict(node)
    allocatable = dict((node.get("status") or {}).get("allocatable") or {})
    for key, amount in used.items():
        if key in allocatable:
            allocatable[key] = str(max(0, parse_quantity(allocatable[key]) - amount))
    return {**node, "status": {**(node.get("status") or {}), "allocatable": allocatable}}


def repelled_nodes(
    spec: ModelFleetSpec, fleet: str, namespace: str, serving: Placement, target: Placement
) -> dict[str, str]:
    """The nodes of ``serving``'s members that ``target``'s may not share, by why: a required pod
    anti-affinity term (hostname) selects a member of either (a pod keeps off the pods its terms
    select, and off those whose terms select it; both revisions carry the same terms)."""
    new = [member_labels(fleet, m.group, m.stage, m.tp_rank) for m in target.members]
    repelled = {}
    for kind, k, selector in pod_terms(spec.placement.affinity, fleet, namespace)[0]:
        if kind != "podAntiAffinity":
            continue
        for m in serving.members:
            old = member_labels(fleet, m.group, m.stage, m.tp_rank)
            if m.node not in repelled and (selects(selector, old) or any(selects(selector, n) for n in new)):
                repelled[m.node] = (
                    f"placement.affinity.podAntiAffinity required term {k} keeps revision {target.revision}'s members off the nodes of revision {serving.revision}'s"
                )
    return repelled


def started_at(status: Obj, revision: str, now: dt.datetime) -> dt.datetime:
    """When the surge of ``revision`` began: the fleet's status says so while it names that
    revision as its ``updateRevision`` (a restarted operator reads it back), else ``now``."""
    if status.get("updateRevision") == revision:
        return parse_timestamp(status.get("rolloutStartedAt")) or now
    return now


def overdue(started: dt.datetime, now: dt.datetime, deadline_seconds: int) -> bool:
    return (now - started).total_seconds() > deadline_seconds


def not_ready(members: Sequence[Obj], pods: Mapping[str, Obj]) -> list[str]:
    """``<pod> (<phase>: <why>)`` for each member that is not Ready: why from the pod's own word
    (a failed scheduling, a waiting container, a status reason), where it gives one."""
    result = []
    for member in members:
        if member["phase"] == "Ready":
            continue
        why = pod_trouble(pods.get(member["pod"])) if member["pod"] in pods else "no pod"
        result.append(f"{member['pod']} ({member['phase']}{': ' + why if why else ''})")
    return result


def pod_trouble(pod: Obj | None) -> str | None:
    """What a pod reports keeps it from running or becoming ready; None when it says nothing."""
    status = (pod or {}).get("status") or {}
    for c in status.get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            return " ".join(str(part) for part in (c.get("reason"), c.get("message")) if part) or "not scheduled"
    for container in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason"):
            return f"container {container.get('name')} {waiting['reason']}"
    return status.get("reason") or None
