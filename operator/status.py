"""A fleet's status as types: phases, condition types and reasons, members; pure functions of
the placement and the pods the API reports.

Members' phases and ``layersLoaded`` come from each agent's ``/status`` (read by the operator;
agents hold no Kubernetes credentials); where an agent does not answer, from its pod.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any

from . import names
from .placement import Placement


class Phase(StrEnum):
    PENDING = "Pending"
    PLANNING = "Planning"
    LOADING = "Loading"
    READY = "Ready"
    DEGRADED = "Degraded"
    FAILED = "Failed"


class MemberPhase(StrEnum):
    """A pod's phase before its agent answers, then the agent's own (modelfleet.agent.health.Phase)."""

    PENDING = "Pending"
    LOADING = "Loading"
    READY = "Ready"
    DRAINING = "Draining"
    FAILED = "Failed"


class Condition(StrEnum):
    MODEL_INSPECTED = "ModelInspected"
    PLANNED = "Planned"
    SCHEDULED = "Scheduled"
    WEIGHTS_LOADED = "WeightsLoaded"
    CHAIN_READY = "ChainReady"
    GATEWAY_READY = "GatewayReady"
    READY = "Ready"
    PROGRESSING = "Progressing"  # a rollout from the serving revision to the generation's (rollout.py)


class Reason(StrEnum):
    INVALID_SPEC = "InvalidSpec"
    SUMMARY_FOUND = "SummaryFound"
    INSPECTING = "Inspecting"
    INSPECTION_FAILED = "InspectionFailed"
    INVALID_MODEL_SUMMARY = "InvalidModelSummary"
    PLANNED = "Planned"
    NO_MATCHING_NODES = "NoMatchingNodes"
    INSUFFICIENT_CAPACITY = "InsufficientCapacity"
    INVALID_FOR_MODEL = "InvalidForModel"
    PODS_SCHEDULED = "PodsScheduled"
    PODS_PENDING = "PodsPending"
    ALL_LAYERS_LOADED = "AllLayersLoaded"
    LAYERS_LOADING = "LayersLoading"
    ALL_GROUPS_READY = "AllGroupsReady"
    SOME_GROUPS_READY = "SomeGroupsReady"
    NO_GROUP_READY = "NoGroupReady"
    GATEWAY_AVAILABLE = "GatewayAvailable"
    GATEWAY_UNAVAILABLE = "GatewayUnavailable"
    FLEET_READY = "FleetReady"
    FLEET_NOT_READY = "FleetNotReady"
    STAGE_CRASH_LOOPING = "StageCrashLooping"
    ROLLING_OUT = "RollingOut"
    ROLLOUT_WITHOUT_SURGE = "RolloutWithoutSurge"
    ROLLOUT_FAILED = "RolloutFailed"
    ROLLOUT_COMPLETE = "RolloutComplete"
    PROGRESS_DEADLINE_EXCEEDED = "ProgressDeadlineExceeded"  # the new revision was not ready in time
    SERVING_STAGE_CRASH_LOOPING = "ServingStageCrashLooping"  # out of restarts while a rollout replaces it


Status = dict[str, Any]


def timestamp(at: dt.datetime) -> str:
    """RFC 3339 in UTC, to the second, as the API server writes times."""
    return at.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_timestamp(text: Any) -> dt.datetime | None:
    """A time :func:`timestamp` (or the API server) wrote; None when ``text`` is not one."""
    try:
        at = dt.datetime.fromisoformat(str(text))
    except ValueError:
        return None
    return at if at.tzinfo is not None else at.replace(tzinfo=dt.UTC)


def now() -> str:
    return timestamp(dt.datetime.now(dt.UTC))


def set_condition(
    conditions: Sequence[Mapping[str, Any]],
    kind: Condition,
    ok: bool,
    reason: Reason,
    message: str,
    generation: int,
    at: dt.datetime | None = None,
) -> list[dict[str, Any]]:
    """``conditions`` with ``kind`` set; lastTransitionTime (``at``, default the clock) moves only
    when the status flips."""
    status = "True" if ok else "False"
    old = next((c for c in conditions if c.get("type") == kind), None)
    changed = old is None or old.get("status") != status
    stamp = timestamp(at) if at is not None else now()
    new = {
        "type": str(kind), "status": status, "reason": str(reason), "message": message,
        "observedGeneration": generation,
        "lastTransitionTime": stamp if changed or old is None else old.get("lastTransitionTime", stamp),
    }  # fmt: skip
    return [dict(c) for c in conditions if c.get("type") != kind] + [new]


def condition(conditions: Sequence[Mapping[str, Any]], kind: Condition) -> Mapping[str, Any] | None:
    return next((c for c in conditions if c.get("type") == kind), None)


def member_phase(pod: Mapping[str, Any] | None, agent: Mapping[str, Any] | None = None) -> MemberPhase:
    """The pod's word on failure, then the agent's own phase (its /status), then pod readiness."""
    if pod is None:
        return MemberPhase.PENDING
    status = pod.get("status") or {}
    if status.get("phase") == "Failed":
        return MemberPhase.FAILED
    if agent is not None and agent.get("phase") in set(MemberPhase):
        return MemberPhase(agent["phase"])
    if any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []):
        return MemberPhase.READY
    return MemberPhase.LOADING if status.get("phase") == "Running" else MemberPhase.PENDING


def members(
    fleet: str,
    placement: Placement,
    pods: Mapping[str, Mapping[str, Any]],
    agents: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """One entry per stage member, in plan order (group, stage, rank); ``agents`` holds the
    members' /status documents by pod name, where they answered."""
    result = []
    for m in placement.members:
        stage = placement.plan.stage(m.group, m.stage)
        pod = names.pod_name(fleet, placement.revision, m.group, m.stage, m.tp_rank, stage.tp_size)
        agent = (agents or {}).get(pod)
        phase = member_phase(pods.get(pod), agent)
        loaded = stage.num_layers if phase == MemberPhase.READY else 0
        if agent is not None and isinstance(agent.get("layers_loaded"), int):
            loaded = min(agent["layers_loaded"], stage.num_layers)
        result.append({
            "group": m.group, "stage": m.stage, "tpRank": m.tp_rank, "pod": pod, "node": m.node,
            "layerStart": stage.layer_start, "layerEnd": stage.layer_end, "phase": str(phase),
            "layersLoaded": loaded, "layersTotal": stage.num_layers,
        })  # fmt: skip
    return result


def scheduled(pod: Mapping[str, Any] | None) -> bool:
    if pod is None:
        return False
    conditions = (pod.get("status") or {}).get("conditions") or []
    on_node = bool((pod.get("spec") or {}).get("nodeName"))
    return on_node or any(c.get("type") == "PodScheduled" and c.get("status") == "True" for c in conditions)
