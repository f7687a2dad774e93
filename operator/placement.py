"""Placement: from a ModelFleetSpec, a ModelSummary and Kubernetes Node objects to a FleetPlan and
the node of every stage member. Pure: plain data in, plain data out, no API calls.

A node matches a fleet when it is Ready and schedulable, carries every ``placement.nodeSelector``
label, passes ``placement.affinity``'s required node affinity (:mod:`.affinity`), tolerates every
NoSchedule/NoExecute taint, and offers the accelerator profile
through its device plugin's allocatable resource (the pods request that resource, so labels alone
would not do):

- ``nvidia-gpu``: ``status.allocatable["nvidia.com/gpu"] >= count`` (NVIDIA device plugin; GPU
  feature discovery's ``nvidia.com/gpu.memory`` label adds device memory, see
  :func:`modelfleet.planner.usable_memory`);
- ``intel-igpu``: ``gpu.intel.com/i915`` or ``gpu.intel.com/xe`` allocatable ``>= count`` (Intel
  GPU device plugin); iGPUs share host RAM and add no memory;
- ``cpu``: every node.

Every member (one pod per tensor rank, requesting ``accelerator.count`` devices) is placed on a node.
Tensor-parallel stages are *packed* when ``parallelism.tensor > 1``, the profile is a GPU one, and
some matching node offers ``tensor * count`` devices and ``tensor`` pods' ``resources``: then each
stage's ranks share one such node (nodes offering fewer are rejected with that reason), and the
stage offers that node's usable memory counting ``tensor * count`` GPUs. Otherwise each rank takes a
node of its own and a stage offers ``tensor * min(usable of its nodes)`` (weights are split evenly
across ranks). A node holds at most one stage. Nodes are taken from the matching ones that best
match ``placement.affinity``'s preferred node affinity (the sum of the weights of the preferences a
node matches), then with the most usable memory, then ordered by name and dealt group by group,
stage by stage (and rank by rank when not packed). Required pod anti-affinity (hostname) that
selects the fleet's members keeps tensor ranks off a shared node; required pod affinity (hostname)
within the fleet needs the whole fleet on one node (:mod:`.affinity`). Layer ranges come from
:func:`modelfleet.planner.split_by_memory` (in proportion to usable memory) unless the spec lists
them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from modelfleet.plan import FleetPlan, PlanError
from modelfleet.planner import (
    InfeasiblePlan,
    assemble_plan,
    context_refusal,
    node_name,
    parse_quantity,
    split_by_memory,
    tensor_refusal,
    usable_memory,
)

from .affinity import HOSTNAME, affinity_rejection, member_labels, pod_terms, preference_score, selects
from .names import model_path, stage_address
from .names import revision as revision_of
from .spec import ModelFleetSpec
from .summary import ModelSummary

Node = Mapping[str, Any]
ACCELERATOR_RESOURCES = {"nvidia-gpu": ("nvidia.com/gpu",), "intel-igpu": ("gpu.intel.com/i915", "gpu.intel.com/xe")}
PLAN_DEVICE = {"nvidia-gpu": "cuda", "intel-igpu": "GPU", "cpu": "cpu"}


@dataclass(frozen=True)
class MemberAssignment:
    group: int
    stage: int
    tp_rank: int
    node: str
    accelerator_resource: str | None  # what the pod requests, e.g. nvidia.com/gpu


@dataclass(frozen=True)
class Placement:
    plan: FleetPlan
    members: tuple[MemberAssignment, ...]
    revision: str  # names.revision: in every pod's name, label and environment


@dataclass(frozen=True)
class Infeasible:
    """Why no plan fits: a condition reason, a message naming the shortfall, the nodes considered."""

    reason: Literal["NoMatchingNodes", "InsufficientCapacity", "InvalidForModel"]
    message: str
    missing_bytes: int = 0
    nodes_considered: tuple[str, ...] = ()
    rejected: Mapping[str, str] | None = None  # node name -> why it does not match


# ---- matching -------------------------------------------------------------------------------


def rejection(node: Node, spec: ModelFleetSpec) -> str | None:
    """Why ``node`` cannot hold a member of this fleet, or None when it can."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    for key, value in spec.placement.node_selector.items():
        if labels.get(key) != value:
            return f"label {key}={value} missing (nodeSelector)"
    if (why := affinity_rejection(node, spec.placement.affinity)) is not None:
        return why
    if (node.get("spec") or {}).get("unschedulable"):
        return "unschedulable (cordoned)"
    if not _ready(node):
        return "not Ready"
    for taint in (node.get("spec") or {}).get("taints") or []:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not _tolerated(taint, spec):
            return f"taint {taint.get('key')}={taint.get('value', '')}:{taint.get('effect')} not tolerated"
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    for resource, wanted in (("cpu", spec.resources.cpu), ("memory", spec.resources.memory)):
        if wanted and resource in allocatable and parse_quantity(allocatable[resource]) < parse_quantity(wanted):
            return f"allocatable {resource} {allocatable[resource]} below resources.{resource}={wanted}"
    if spec.accelerator.profile != "cpu" and accelerator_resource(node, spec) is None:
        names = " or ".join(ACCELERATOR_RESOURCES[spec.accelerator.profile])
        return f"allocatable {names} below {spec.accelerator.devices_per_pod} (accelerator.profile={spec.accelerator.profile})"
    return None


def accelerator_resource(node: Node, spec: ModelFleetSpec) -> str | None:
    """The device plugin resource this node offers enough of for one pod, or None."""
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    for resource in ACCELERATOR_RESOURCES.get(spec.accelerator.profile, ()):
        if parse_quantity(allocatable.get(resource, 0)) >= spec.accelerator.devices_per_pod:
            return resource
    return None


def stage_rejection(node: Node, spec: ModelFleetSpec) -> str | None:
    """Why a matching ``node`` cannot hold all ``tensor`` ranks of one stage, or None when it can."""
    tp, allocatable = spec.parallelism.tensor, (node.get("status") or {}).get("allocatable") or {}
    resource = accelerator_resource(node, spec) or ACCELERATOR_RESOURCES[spec.accelerator.profile][0]
    need = tp * spec.accelerator.devices_per_pod
    if parse_quantity(allocatable.get(resource, 0)) < need:
        have = allocatable.get(resource, 0)
        return f"allocatable {resource} {have} below parallelism.tensor x accelerator.count = {need} (a stage's ranks share one node)"
    for resource, wanted in (("cpu", spec.resources.cpu), ("memory", spec.resources.memory)):
        if wanted and resource in allocatable and parse_quantity(allocatable[resource]) < tp * parse_quantity(wanted):
            return f"allocatable {resource} {allocatable[resource]} below parallelism.tensor x resources.{resource} ({tp} x {wanted})"
    return None


def packs_stages(spec: ModelFleetSpec, matching: Sequence[Node]) -> bool:
    """Whether each stage's tensor ranks go on one node: a GPU profile, tensor > 1, a node fits."""
    if spec.accelerator.profile == "cpu" or spec.parallelism.tensor == 1:
        return False
    return any(stage_rejection(n, spec) is None for n in matching)


def _ready(node: Node) -> bool:
    conditions = (node.get("status") or {}).get("conditions")
    if not conditions:  # a Node object without conditions (e.g. in a test file) counts as ready
        return True
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _tolerated(taint: Mapping[str, Any], spec: ModelFleetSpec) -> bool:
    for tol in spec.placement.tolerations:
        key_matches = tol.key is None and tol.operator == "Exists" or tol.key == taint.get("key")
        value_matches = tol.operator == "Exists" or tol.value == taint.get("value")
        if key_matches and value_matches and tol.effect in (None, taint.get("effect")):
            return True
    return False


# ---- planning -------------------------------------------------------------------------------


def place(
    spec: ModelFleetSpec, summary: ModelSummary, nodes: Sequence[Node], fleet: str, namespace: str
) -> Placement | Infeasible:
    """The plan and member nodes for ``spec``, or why none fits."""
    rejected = {node_name(n): why for n in nodes if (why := rejection(n, spec)) is not None}
    matching = [n for n in nodes if node_name(n) not in rejected]
    considered = tuple(sorted(node_name(n) for n in nodes))
    if not matching:
        return Infeasible("NoMatchingNodes", _no_match_message(spec, rejected), 0, considered, rejected)
    tp = spec.parallelism.tensor
    apart = _ranks_apart(spec, summary, fleet, namespace)  # an anti-affinity term forbids packing
    packed = packs_stages(spec, matching) and apart is None
    if packed:
        rejected.update({node_name(n): why for n in matching if (why := stage_rejection(n, spec)) is not None})
        matching = [n for n in matching if node_name(n) not in rejected]
    per_stage = 1 if packed else tp  # nodes per stage
    width = per_stage * spec.replicas
    stages = spec.pipeline or min(summary.num_layers, len(matching) // width)
    if stages < 1 or stages * width > len(matching):
        need = max(stages, 1) * width
        ranks = f"{tp} ranks on one node" if packed else f"{tp} ranks"
        message = f"the fleet needs {need} matching nodes ({max(stages, 1)} stages x {ranks} x {spec.replicas} groups), {len(matching)} match: {', '.join(sorted(node_name(n) for n in matching))}"
        if rejected:
            message += "; not matching: " + "; ".join(f"{name}: {why}" for name, why in sorted(rejected.items()))
        if apart is not None and tp > 1:
            message += f"; {apart} keeps a stage's ranks on nodes of their own"
        return Infeasible("InsufficientCapacity", message, 0, considered, rejected)
    if stages > summary.num_layers:
        return Infeasible(
            "InvalidForModel", f"parallelism.pipeline={stages} exceeds the model's {summary.num_layers} layers"
        )
    if (why := model_refusal(spec, summary)) is not None:
        return Infeasible("InvalidForModel", why, 0, considered, rejected)
    affinity = spec.placement.affinity
    chosen = sorted(matching, key=lambda n: (-preference_score(n, affinity), -usable_memory(n), node_name(n)))
    chosen = sorted(chosen[: stages * width], key=node_name)
    try:
        placement = _plan(spec, summary, chosen, stages, per_stage, fleet, namespace)
        if (why := _together_failure(placement, spec, fleet, namespace)) is not None:
            return Infeasible("InsufficientCapacity", why, 0, considered, rejected)
        return placement
    except InfeasiblePlan as exc:
        return Infeasible("InsufficientCapacity", str(exc), exc.missing_bytes, considered, rejected)
    except PlanError as exc:
        return Infeasible("InvalidForModel", str(exc), 0, considered, rejected)


def model_refusal(spec: ModelFleetSpec, summary: ModelSummary) -> str | None:
    """Why the model cannot be served as ``spec`` asks (the planner's refusals, in the spec's
    field names), where the summary records what they need."""
    split = tuple(summary.tensor_split.items())
    if (why := tensor_refusal(split, spec.parallelism.tensor, "parallelism.tensor")) is not None:
        return why
    if summary.max_position_embeddings is None:
        return None
    return context_refusal(summary.max_position_embeddings, spec.serving.context_length, "serving.contextLength")


def _ranks_apart(spec: ModelFleetSpec, summary: ModelSummary, fleet: str, namespace: str) -> str | None:
    """The required pod anti-affinity term (hostname) that selects a member of some stage, so that
    stage's tensor ranks may not share a node; None when ranks may share one."""
    stages, ranks = spec.pipeline or summary.num_layers, range(spec.parallelism.tensor)
    for kind, k, selector in pod_terms(spec.placement.affinity, fleet, namespace)[0]:
        every = ((g, s, r) for g in range(spec.replicas) for s in range(stages) for r in ranks)
        if kind == "podAntiAffinity" and any(selects(selector, member_labels(fleet, *m)) for m in every):
            return f"placement.affinity.podAntiAffinity required term {k}"
    return None


def _together_failure(placement: Placement, spec: ModelFleetSpec, fleet: str, namespace: str) -> str | None:
    """Why a required pod affinity term (hostname, within the fleet) fails the placement: the
    scheduler places a pod only beside a pod its term selects (the first one anywhere), so every
    member must be on one node with a member the term selects."""
    nodes = sorted({m.node for m in placement.members})
    for kind, k, selector in pod_terms(spec.placement.affinity, fleet, namespace)[0]:
        term = f"placement.affinity.podAffinity required term {k} ({HOSTNAME})"
        if kind != "podAffinity":
            continue
        if not any(selects(selector, member_labels(fleet, m.group, m.stage, m.tp_rank)) for m in placement.members):
            return f"{term} selects no member of fleet {fleet}, so no stage pod can be scheduled"
        if len(nodes) > 1:
            return f"{term} needs every member on one node, beside a member it selects; the plan puts them on {', '.join(nodes)} (a node holds one stage)"
    return None


def shortfall(placement: Placement, spec: ModelFleetSpec, nodes: Sequence[Node]) -> str | None:
    """Why ``placement``'s stages do not fit ``nodes`` as they are given (another revision's members
    may hold part of them: :func:`.rollout.free_nodes`), or None when every stage fits."""
    by_name = {node_name(n): n for n in nodes}
    for group in placement.plan.groups:
        for stage in group.stages:
            here = (group.group_index, stage.stage_index)
            names = list(dict.fromkeys(m.node for m in placement.members if (m.group, m.stage) == here))
            if missing := [n for n in names if n not in by_name]:
                return f"node {missing[0]} is gone"
            stage_nodes = [by_name[n] for n in names]
            packed = len(stage_nodes) < spec.parallelism.tensor
            for node in stage_nodes:
                if why := rejection(node, spec) or (stage_rejection(node, spec) if packed else None):
                    return f"{node_name(node)}: {why}"
            need, usable = stage.weights_bytes + stage.kv_budget_bytes, _stage_usable(spec, stage_nodes)
            if need > usable:
                where = f"{'+'.join(names)} (group {here[0]}, stage {here[1]})"
                return f"{where} needs {need} bytes, has {usable}, short by {need - usable} bytes"
    return None


def _no_match_message(spec: ModelFleetSpec, rejected: Mapping[str, str]) -> str:
    if not rejected:
        return "the cluster has no nodes"
    reasons = "; ".join(f"{name}: {why}" for name, why in sorted(rejected.items()))
    return f"no node matches accelerator.profile={spec.accelerator.profile} and placement: {reasons}"


def _plan(
    spec: ModelFleetSpec,
    summary: ModelSummary,
    chosen: list[Node],
    stages: int,
    per_stage: int,
    fleet: str,
    namespace: str,
) -> Placement:
    """``per_stage`` is the number of nodes a stage spans: ``tensor``, or 1 when its ranks share one."""
    tp = spec.parallelism.tensor
    streams_per_group = -(-spec.serving.max_streams // spec.replicas)
    kv = summary.kv_bytes(streams_per_group, spec.serving.context_length)
    members, ranges = [], []
    for g in range(spec.replicas):
        group_nodes = chosen[g * stages * per_stage : (g + 1) * stages * per_stage]
        stage_nodes = [group_nodes[s * per_stage : (s + 1) * per_stage] for s in range(stages)]
        ranges.append(_ranges(spec, summary, kv, stage_nodes))
        members += [
            # rank r on the r-th node of its stage, or on the stage's one node when packed
            MemberAssignment(g, s, r, node_name(nodes[r % per_stage]), accelerator_resource(nodes[r % per_stage], spec))
            for s, nodes in enumerate(stage_nodes)
            for r in range(tp)
        ]
    # The revision hashes the plan without its addresses (which name the revision), the nodes and
    # what else shapes a stage pod (image, resources, placement, model source...), so that any of
    # them changing rolls out new pods; gateway, restart and rollout settings shape no stage pod.
    unaddressed = _build(spec, summary, ranges, kv, fleet, namespace, "0")
    nodes = ",".join(f"{m.group}/{m.stage}/{m.tp_rank}={m.node}" for m in members)
    pod_inputs = spec.model_dump_json(exclude={"gateway", "restart_policy", "rollout"})
    revision = revision_of(f"{unaddressed.plan_hash()}\n{pod_inputs}", nodes)
    plan = _build(spec, summary, ranges, kv, fleet, namespace, revision)
    return Placement(plan, tuple(members), revision)


def _ranges(
    spec: ModelFleetSpec, summary: ModelSummary, kv: list[int], stage_nodes: list[list[Node]]
) -> list[tuple[int, int]]:
    """Layer ranges of one group: the spec's, checked against memory, or split by memory."""
    sizes, stages = summary.sizes(spec.model.formats), len(stage_nodes)
    usable = [_stage_usable(spec, ranks) for ranks in stage_nodes]
    names = ["+".join(node_name(n) for n in ranks) for ranks in stage_nodes]
    head = sizes.norm_bytes if stages == 1 and sizes.tied else sizes.head_bytes
    if spec.stages is None:
        return split_by_memory(sizes.per_layer, sizes.embed_bytes, head, usable, kv, names)
    ranges = [(r.layer_start, r.layer_end) for r in spec.stages]
    if ranges[-1][1] != summary.num_layers:
        raise PlanError(
            f"stages[{stages - 1}].layerEnd={ranges[-1][1]} must equal the model's {summary.num_layers} layers"
        )
    for k, (a, b) in enumerate(ranges):
        need = sizes.stage_bytes(a, b) + sum(kv[a:b])
        if need > usable[k]:
            short = need - usable[k]
            raise InfeasiblePlan(
                f"{names[k]} (stage {k}, layers [{a}, {b})) needs {need} bytes, has {usable[k]}, short by {short} bytes",
                short, tuple(max(0, need - u) if i == k else 0 for i, u in enumerate(usable)),
            )  # fmt: skip
    return ranges


def _stage_usable(spec: ModelFleetSpec, nodes: list[Node]) -> int:
    """Bytes one stage offers: its one node with ``tensor * count`` of its GPUs when its ranks share
    the node, else ``tensor * min(usable)`` of its nodes (weights split evenly across ranks)."""
    tp = spec.parallelism.tensor
    if len(nodes) == tp:
        return tp * min(usable_memory(n) for n in nodes)
    (node,) = nodes
    allocatable = dict((node.get("status") or {}).get("allocatable") or {})
    if "nvidia.com/gpu" in allocatable:  # only the stage's GPUs add their memory
        allocatable["nvidia.com/gpu"] = str(tp * spec.accelerator.devices_per_pod)
    return usable_memory({**node, "status": {**(node.get("status") or {}), "allocatable": allocatable}})


def _build(
    spec: ModelFleetSpec,
    summary: ModelSummary,
    ranges: list[list[tuple[int, int]]],
    kv: list[int],
    fleet: str,
    namespace: str,
    revision: str,
) -> FleetPlan:
    """The plan of ``ranges`` under ``revision`` (its pods' names are the stages' addresses)."""
    model = {
        "path": model_path(spec.model.uri), "served_name": spec.model.served_name, "family": summary.family,
        "num_layers": summary.num_layers, "dtype": summary.dtype, "formats": spec.model.formats,
    }  # fmt: skip
    serving = {
        "max_streams": spec.serving.max_streams, "context_length": spec.serving.context_length,
        "window_rows": spec.serving.window_rows, "max_queue": spec.gateway.max_queue,
        "queue_timeout_seconds": float(spec.gateway.queue_timeout_seconds),
        "replay_timeout_seconds": float(spec.serving.replay_timeout_seconds),
        "speculative": None if spec.serving.speculative is None else spec.serving.speculative.plan_fields(),
        "gpu_memory_bytes": spec.serving.gpu_memory_bytes,
    }  # fmt: skip
    tp = spec.parallelism.tensor
    return assemble_plan(
        model, ranges, summary.sizes(spec.model.formats), kv,
        address_of=lambda g, s: stage_address(fleet, namespace, revision, g, s, tp),
        device_of=lambda g, s: PLAN_DEVICE[spec.accelerator.profile],
        tp_size=tp, backend=spec.backend, serving=serving,
    )  # fmt: skip
