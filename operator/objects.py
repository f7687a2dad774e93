"""Kubernetes objects of a fleet, as plain dicts: pure functions of the fleet, its spec and plan.

Every object carries ``modelfleet.io/fleet`` and an ownerReference to the ModelFleet (deleting the
fleet deletes them). Quantities are strings. Stage pods use ``restartPolicy: Never``: a failed
stage is replaced by the operator, which counts the replacements (``restartPolicy.maxStageRestarts``).
A pod is bound to its planned node by a required node affinity on ``metadata.name`` (as DaemonSets
are), so the scheduler still checks resources; that replaces ``placement.affinity``'s required node
affinity, which the planner has already evaluated; its other parts are kept. The tensor ranks of a
packed stage are pods of their own bound to the same node.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
import os
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

from modelfleet import __version__
from modelfleet.plan import StagePlan
from modelfleet.planner import parse_quantity

from . import names
from .placement import MemberAssignment, Placement
from .spec import GROUP, KIND, VERSION, ModelFleetSpec, Resources

Obj = dict[str, Any]
# what images/build.sh tags (REGISTRY/IMAGE:VERSION), by accelerator profile; the chart's values
# name the same repositories and may pin them by digest
IMAGE_REGISTRY = "ghcr.io/modelfleet"
PROFILE_IMAGES = {"cpu": "agent-cpu", "nvidia-gpu": "agent-cuda", "intel-igpu": "agent-openvino"}
HF_ENDPOINT_ENV = (
    "MF_HF_ENDPOINT"  # the operator's HF_ENDPOINT for hf:// fleets without model.endpoint (chart: hub.endpoint)
)
AGENT_IMAGE_ENV = "MF_AGENT_IMAGE_"  # + the profile: MF_AGENT_IMAGE_CPU, _NVIDIA_GPU, _INTEL_IGPU (set by the chart)
MODEL_MOUNT_DIR = names.MODEL_MOUNT_DIR
SCRATCH_DIR = "/tmp"
STARTUP_BASE_SECONDS = 300
STARTUP_LOAD_BYTES_PER_SECOND = 50 * 10**6
# the images run as uid/gid 10001 (images/runtime.sh); nothing in a pod needs root or a capability
IMAGE_USER = 10001
POD_SECURITY: Obj = {
    "runAsNonRoot": True, "runAsUser": IMAGE_USER, "runAsGroup": IMAGE_USER, "seccompProfile": {"type": "RuntimeDefault"},
}  # fmt: skip
# a stage pod that does not set resources: one core, and (on CPU and iGPU nodes, where the weights
# live in host memory) its share of the planned weights and KV cache plus the runtime's own
DEFAULT_STAGE_CPU = "1"
STAGE_RUNTIME_BYTES = 1 << 30  # Python, torch, the agent's buffers: a stage process's RSS before weights
HOST_MEMORY_PROFILES = ("cpu", "intel-igpu")
# who may reach a stage's HTTP port (/status, /metrics) from outside its fleet: the operator (its
# namespace from the downward API, set by the chart) and a monitoring namespace (chart values)
OPERATOR_NAMESPACE_ENV, DEFAULT_OPERATOR_NAMESPACE = "MF_OPERATOR_NAMESPACE", "modelfleet-system"
OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "modelfleet", "app.kubernetes.io/component": "operator"}
MONITORING_NAMESPACE_ENV, DEFAULT_MONITORING_NAMESPACE = "MF_MONITORING_NAMESPACE", "monitoring"
MONITORING_POD_LABELS_ENV = "MF_MONITORING_POD_LABELS"  # k=v,k=v; empty: any pod of that namespace
# an OpenVINO stage also compiles its blocks: ~5 s per GiB of int4 weights on 2 cores
# (docs/results/openvino_stage.md), budgeted twice over
STARTUP_COMPILE_BYTES_PER_SECOND = 2**30 // 10
OPENVINO_CACHE_DIR = SCRATCH_DIR + "/openvino"  # compiled blocks: the scratch volume keeps them for the pod
CONTAINER_SECURITY: Obj = {
    "runAsNonRoot": True, "readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
}  # fmt: skip


def owner_reference(fleet: Mapping[str, Any]) -> Obj:
    meta = fleet["metadata"]
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": meta["name"], "uid": meta["uid"],
        "controller": True, "blockOwnerDeletion": True,
    }  # fmt: skip


def _metadata(fleet: Mapping[str, Any], name: str, component: str | None = None, **labels: str) -> Obj:
    meta = fleet["metadata"]
    all_labels = {names.LABEL_FLEET: meta["name"], **labels}
    if component:
        all_labels[names.LABEL_COMPONENT] = component
    result: Obj = {"name": name, "namespace": meta["namespace"], "labels": all_labels}
    if meta.get("uid"):  # render prints objects for a fleet that does not exist yet
        result["ownerReferences"] = [owner_reference(fleet)]
    return result


def agent_image_env(profile: str) -> str:
    return AGENT_IMAGE_ENV + profile.upper().replace("-", "_")


def default_image(profile: str) -> str:
    """The agent image images/build.sh builds for an accelerator profile, at this version."""
    return f"{IMAGE_REGISTRY}/{PROFILE_IMAGES[profile]}:{__version__}"


def agent_image(spec: ModelFleetSpec) -> str:
    """``spec.images.agent``, else the operator's image for the accelerator profile (backend
    openvino takes the OpenVINO image, intel-igpu's, on cpu nodes too) (its environment, which the
    Helm chart fills from its values), else :func:`default_image`."""
    profile = "intel-igpu" if spec.backend == "openvino" else spec.accelerator.profile
    return spec.images.agent or os.environ.get(agent_image_env(profile)) or default_image(profile)


def gateway_image(spec: ModelFleetSpec) -> str:
    """The gateway needs no accelerator: the CPU agent image unless the spec names one."""
    return spec.images.gateway or os.environ.get(agent_image_env("cpu")) or default_image("cpu")


def selector(fleet: str, component: str) -> dict[str, str]:
    return {names.LABEL_FLEET: fleet, names.LABEL_COMPONENT: component}


# ---- the plan ---------------------------------------------------------------------------------


def plan_config_map(
    fleet: Mapping[str, Any], placement: Placement, revision_scoped: bool = False, spec: ModelFleetSpec | None = None
) -> Obj:
    """The plan, plus the member nodes: the fleet's record of its current generation's plan (the
    operator keeps a plan while its generation holds and its nodes still match), or, revision
    scoped, the copy that revision's pods mount (two revisions run side by side in a rollout), with
    ``spec``, the fleet spec its pods are made from (a pod of the serving revision recreated during
    a rollout is made from it, not from the new spec)."""
    fleet_name, revision = fleet["metadata"]["name"], placement.revision
    if revision_scoped:
        meta = _metadata(
            fleet, names.revision_plan_config_map(fleet_name, revision), **{names.LABEL_REVISION: revision}
        )
    else:
        meta = _metadata(fleet, names.plan_config_map(fleet_name))
    meta["annotations"] = {names.ANNOTATION_PLAN_HASH: placement.plan.plan_hash(), names.ANNOTATION_REVISION: revision}
    if not revision_scoped:
        meta["annotations"][names.ANNOTATION_GENERATION] = str(fleet["metadata"].get("generation", 0))
    members = json.dumps([dataclasses.asdict(m) for m in placement.members], indent=1)
    data = {names.PLAN_KEY: placement.plan.to_json(), names.MEMBERS_KEY: members}
    if revision_scoped and spec is not None:
        data[names.SPEC_KEY] = spec.model_dump_json(by_alias=True, exclude_none=True)
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}


# ---- stage pods -------------------------------------------------------------------------------


def stage_pod(fleet: Mapping[str, Any], spec: ModelFleetSpec, placement: Placement, member: MemberAssignment) -> Obj:
    fleet_name, revision = fleet["metadata"]["name"], placement.revision
    stage = placement.plan.stage(member.group, member.stage)
    name = names.pod_name(fleet_name, revision, member.group, member.stage, member.tp_rank, stage.tp_size)
    labels = {
        names.LABEL_GROUP: str(member.group), names.LABEL_STAGE_INDEX: str(member.stage),
        names.LABEL_TP_RANK: str(member.tp_rank), names.LABEL_REVISION: revision,
    }  # fmt: skip
    meta = _metadata(fleet, name, "stage", **labels)
    meta["annotations"] = {names.ANNOTATION_PLAN_HASH: placement.plan.plan_hash()}
    model_volume, model_env = _model_volume(spec)
    # MF_STAGE and MF_GROUP are what `modelfleet agent` reads; the others describe the pod
    env = [
        _env("MF_FLEET", fleet_name), _env("MF_REVISION", revision),
        _env("MF_PLAN", f"{names.PLAN_MOUNT_DIR}/{names.PLAN_KEY}"), _env("MF_GROUP", str(member.group)),
        _env("MF_STAGE", str(member.stage)), _env("MF_STAGE_INDEX", str(member.stage)),
        _env("MF_LAYER_START", str(stage.layer_start)), _env("MF_LAYER_END", str(stage.layer_end)),
        _env("MF_TP_RANK", str(member.tp_rank)), _env("MF_TP_SIZE", str(stage.tp_size)),
        _env("MF_NUMA", spec.placement.numa), *model_env,
        _env("MF_HTTP_HOST", "0.0.0.0"), _env("MF_KEYS_DIR", names.TRANSPORT_KEYS_DIR), _env("HOME", SCRATCH_DIR),
        {"name": "MF_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "MF_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
    ]  # fmt: skip
    if stage.backend == "openvino":
        env.append(_env("MF_OPENVINO_CACHE_DIR", OPENVINO_CACHE_DIR))
    container = {
        "name": "agent", "image": agent_image(spec), "imagePullPolicy": spec.images.pull_policy,
        "command": ["modelfleet", "agent"], "env": env, "resources": _stage_resources(spec, stage, member),
        "ports": _stage_ports(stage.tp_size > 1 and member.tp_rank == 0),
        # the agent answers /healthz from the start of loading and /readyz once its layers are in;
        # the startup budget covers the start of the process and loading the stage's weights
        "startupProbe": _probe("/healthz", names.AGENT_HTTP_PORT, period=10, failures=_startup_failures(stage.weights_bytes, stage.backend == "openvino")),
        "readinessProbe": _probe("/readyz", names.AGENT_HTTP_PORT, period=5),
        "livenessProbe": _probe("/healthz", names.AGENT_HTTP_PORT, period=10, failures=6),
        "securityContext": CONTAINER_SECURITY,
        "volumeMounts": [_plan_mount(), _model_mount(spec), _transport_mount(), _scratch_mount()],
    }  # fmt: skip
    pod_spec = {
        "hostname": name, "subdomain": names.stage_service(fleet_name), "restartPolicy": "Never",
        "affinity": _affinity(spec, member.node), "containers": [container],
        "volumes": [_plan_volume(fleet_name, revision), model_volume, _transport_volume(fleet_name), _scratch_volume()],
        "automountServiceAccountToken": False, "securityContext": POD_SECURITY,
    }  # fmt: skip
    pod_spec = _with_fetch(pod_spec, spec, resources=_stage_resources(spec, stage, member))
    if spec.placement.tolerations:
        pod_spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in spec.placement.tolerations]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


def _stage_ports(rendezvous: bool) -> list[Obj]:
    """Frames and HTTP; rank 0 of a tensor group also hosts its rendezvous (gloo's and NCCL's own
    links between the ranks use ephemeral ports, which the stages' NetworkPolicy allows)."""
    ports = [
        {"name": "agent", "containerPort": names.AGENT_PORT},
        {"name": "http", "containerPort": names.AGENT_HTTP_PORT},
    ]
    return ports + ([{"name": "tensor", "containerPort": names.TENSOR_PORT}] if rendezvous else [])


def _startup_failures(weights_bytes: int, compiles: bool = False) -> int:
    """Startup probe failures (10 s apart) allowed: 5 minutes, plus the stage's weights at
    STARTUP_LOAD_BYTES_PER_SECOND (a slow network volume), plus their compile time on an OpenVINO
    stage (``compiles``), for at most a day."""
    budget_seconds = STARTUP_BASE_SECONDS + weights_bytes / STARTUP_LOAD_BYTES_PER_SECOND
    if compiles:
        budget_seconds += weights_bytes / STARTUP_COMPILE_BYTES_PER_SECOND
    return min(8640, max(1, -(-int(budget_seconds) // 10)))


def _scratch_volume() -> Obj:
    return {"name": "scratch", "emptyDir": {}}


def _scratch_mount() -> Obj:
    """The root filesystem is read-only: caches (HOME, torch, OpenVINO) write here."""
    return {"name": "scratch", "mountPath": SCRATCH_DIR}


def _env(name: str, value: str) -> Obj:
    return {"name": name, "value": value}


def _probe(path: str, port: int, period: int, failures: int = 3) -> Obj:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "failureThreshold": failures}


def _stage_resources(spec: ModelFleetSpec, stage: StagePlan, member: MemberAssignment) -> Obj:
    """``resources``, with a stage's defaults (:data:`DEFAULT_STAGE_CPU`, :func:`stage_memory`);
    with ``placement.numa: single-numa-node``, limits equal to the requests and whole CPUs
    (Guaranteed QoS: the kubelet's static CPU and topology managers pin only such pods to one NUMA
    node's cores)."""
    given = spec.resources
    cpu, memory = given.cpu or DEFAULT_STAGE_CPU, given.memory or stage_memory(spec, stage)
    if spec.placement.numa == "single-numa-node":
        cpu = str(parse_quantity(cpu))  # rounded up
        result = _pod_resources(given.model_copy(update={"cpu": cpu, "memory": memory, "cpu_limit": cpu}))
    else:
        result = _pod_resources(given.model_copy(update={"cpu": cpu, "memory": memory}))
    if member.accelerator_resource and spec.accelerator.devices_per_pod:
        result.setdefault("limits", {})[member.accelerator_resource] = str(spec.accelerator.devices_per_pod)
    return result


def stage_memory(spec: ModelFleetSpec, stage: StagePlan) -> str | None:
    """A stage pod's default memory request where its weights live in host memory: its rank's share
    of the stage's planned weights and KV cache, plus :data:`STAGE_RUNTIME_BYTES`, in MiB rounded
    up. None on NVIDIA nodes, where the split between device and host memory is the engine's."""
    if spec.accelerator.profile not in HOST_MEMORY_PROFILES:
        return None
    share = -(-(stage.weights_bytes + stage.kv_budget_bytes) // stage.tp_size)
    return f"{-(-(share + STAGE_RUNTIME_BYTES) // 2**20)}Mi"


def _pod_resources(resources: Resources) -> Obj:
    """A container's requests and limits: memory is limited to its request unless ``memoryLimit``
    says more; CPU only where ``cpuLimit`` is given."""
    requests = {k: v for k, v in (("cpu", resources.cpu), ("memory", resources.memory)) if v}
    limit_memory = resources.memory_limit or resources.memory
    limits = {k: v for k, v in (("cpu", resources.cpu_limit), ("memory", limit_memory)) if v}
    return {kind: values for kind, values in (("requests", requests), ("limits", limits)) if values}


def _affinity(spec: ModelFleetSpec, node: str) -> Obj:
    affinity = copy.deepcopy(spec.placement.affinity or {})
    node_affinity = affinity.setdefault("nodeAffinity", {})
    term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
    node_affinity["requiredDuringSchedulingIgnoredDuringExecution"] = {"nodeSelectorTerms": [term]}
    return affinity


def _plan_volume(fleet_name: str, revision: str) -> Obj:
    return {"name": "plan", "configMap": {"name": names.revision_plan_config_map(fleet_name, revision)}}


def _plan_mount() -> Obj:
    return {"name": "plan", "mountPath": names.PLAN_MOUNT_DIR, "readOnly": True}


def _model_mount(spec: ModelFleetSpec) -> Obj:
    return {"name": "model", "mountPath": MODEL_MOUNT_DIR, "readOnly": True}  # for hf://, only the fetch writes


def _transport_volume(fleet_name: str) -> Obj:
    return {"name": "transport", "secret": {"secretName": names.transport_secret(fleet_name), "defaultMode": 0o400}}


def _transport_mount() -> Obj:
    return {"name": "transport", "mountPath": names.TRANSPORT_KEYS_DIR, "readOnly": True}


def transport_secret(fleet: Mapping[str, Any], public_key: str, secret_key: str) -> Obj:
    """The fleet's CURVE key pair (z85), shared by its agents and gateway; made once by the caller,
    since keys are random and these builders are pure."""
    data = {"fleet.key": public_key, "fleet.key_secret": secret_key}
    encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
    meta = _metadata(fleet, names.transport_secret(fleet["metadata"]["name"]))
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque", "data": encoded}


def _model_volume(spec: ModelFleetSpec) -> tuple[Obj, list[Obj]]:
    """The checkpoint volume and MF_MODEL_PATH; hf:// models are fetched into ``model.cache``'s claim
    or an emptyDir (downloaded again whenever a pod is replaced)."""
    uri = spec.model.uri
    if uri.startswith("pvc://"):
        claim = uri.removeprefix("pvc://").partition("/")[0]
        volume = {"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        return volume, [_env("MF_MODEL_PATH", names.model_path(uri))]
    if uri.startswith("hostpath://"):
        volume = {"name": "model", "hostPath": {"path": uri.removeprefix("hostpath://"), "type": "Directory"}}
        return volume, [_env("MF_MODEL_PATH", names.model_path(uri))]
    cache = spec.model.cache
    volume = {
        "name": "model",
        **({"persistentVolumeClaim": {"claimName": cache.claim_name}} if cache else {"emptyDir": {}}),
    }
    return volume, [_env("MF_MODEL_PATH", names.model_path(uri))]


def _with_fetch(pod_spec: Obj, spec: ModelFleetSpec, weights: bool = True, resources: Obj | None = None) -> Obj:
    """For an hf:// model, an init container fetches it into the model volume before the pod's
    containers start; a complete snapshot already there (a cache claim) costs one listing request.

    It takes the ``resources`` of the pod's container, less accelerators: a pod is Guaranteed (and
    NUMA-pinned) only if its init containers are too, and the pod's request stays the container's."""
    if not spec.model.uri.startswith("hf://"):
        return pod_spec
    command = ["modelfleet", "fetch", spec.model.uri, "--out", names.model_path(spec.model.uri)]
    fetch = {
        "name": "fetch", "image": agent_image(spec), "imagePullPolicy": spec.images.pull_policy,
        "command": command if weights else [*command, "--no-weights"], "env": [*_hub_env(spec), _env("HOME", SCRATCH_DIR)],
        "securityContext": CONTAINER_SECURITY,
        "volumeMounts": [{"name": "model", "mountPath": MODEL_MOUNT_DIR}, _scratch_mount()],
    }  # fmt: skip
    compute = {
        kind: {name: value for name, value in quantities.items() if name in ("cpu", "memory")}
        for kind, quantities in (resources or {}).items()
    }
    if compute := {kind: quantities for kind, quantities in compute.items() if quantities}:
        fetch["resources"] = compute
    return {**pod_spec, "initContainers": [fetch]}


def _hub_env(spec: ModelFleetSpec) -> list[Obj]:
    """HF_TOKEN from ``model.tokenSecret``, HF_ENDPOINT from ``model.endpoint`` (else the operator's
    :data:`HF_ENDPOINT_ENV`), the Hub client's own files on the scratch volume (read-only root)."""
    env = [_env("HF_HOME", f"{SCRATCH_DIR}/huggingface")]
    if secret := spec.model.token_secret:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": secret.name, "key": secret.key}}})
    if endpoint := spec.model.endpoint or os.environ.get(HF_ENDPOINT_ENV):
        env.append(_env("HF_ENDPOINT", endpoint))
    return env


# ---- model inspection -------------------------------------------------------------------------


def inspection_job(fleet: Mapping[str, Any], spec: ModelFleetSpec) -> Obj:
    """A Job that reads the checkpoint's config and safetensors headers and reports its ModelSummary
    as the pod's termination message (so it needs no Kubernetes credentials); the operator copies
    the message into the summary ConfigMap. A local checkpoint (pvc://, hostpath://) is mounted; an
    hf:// one is read over HTTP Range requests, with no volume and no weight bytes."""
    fleet_name = fleet["metadata"]["name"]
    model_volume, model_env = _model_volume(spec)
    hub = spec.model.uri.startswith("hf://")
    if hub:
        model_env = [_env("MF_MODEL_URI", spec.model.uri), *_hub_env(spec)]
    source = "$MF_MODEL_URI" if hub else "$MF_MODEL_PATH"
    model_mounts = [] if hub else [{"name": "model", "mountPath": MODEL_MOUNT_DIR, "readOnly": True}]
    container = {
        "name": "inspect", "image": agent_image(spec), "imagePullPolicy": spec.images.pull_policy,
        "command": ["sh", "-c", f'exec modelfleet inspect --model "{source}" --output /dev/termination-log'],
        "env": [*model_env, _env("HOME", SCRATCH_DIR)], "terminationMessagePolicy": "File",
        "securityContext": CONTAINER_SECURITY, "volumeMounts": [*model_mounts, _scratch_mount()],
    }  # fmt: skip
    pod_spec = {
        "restartPolicy": "Never",
        "containers": [container],
        "volumes": [_scratch_volume()] if hub else [model_volume, _scratch_volume()],
        "automountServiceAccountToken": False,
        "securityContext": POD_SECURITY,
    }
    if spec.placement.tolerations:
        pod_spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in spec.placement.tolerations]
    labels = {**selector(fleet_name, "inspect"), names.LABEL_MODEL: names.model_key(spec.model.uri)}
    template = {"metadata": {"labels": labels}, "spec": pod_spec}
    meta = _metadata(fleet, names.inspection_job(fleet_name, spec.model.uri), "inspect")
    meta["labels"] = labels
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {"backoffLimit": 2, "template": template},
    }


def summary_config_map(fleet: Mapping[str, Any], spec: ModelFleetSpec, text: str) -> Obj:
    """The summary an inspection reported, labelled with the model it describes."""
    from .summary import SUMMARY_KEY, summary_config_map_name

    meta = _metadata(fleet, summary_config_map_name(fleet["metadata"]["name"]))
    meta["labels"][names.LABEL_MODEL] = names.model_key(spec.model.uri)
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {SUMMARY_KEY: text}}


# ---- services, gateway, policies --------------------------------------------------------------


def stage_service(fleet: Mapping[str, Any]) -> Obj:
    """Headless: one DNS record per stage pod, published before the pod is ready (peers dial early)."""
    fleet_name = fleet["metadata"]["name"]
    ports = [
        {"name": "agent", "port": names.AGENT_PORT, "targetPort": "agent"},
        {"name": "http", "port": names.AGENT_HTTP_PORT, "targetPort": "http"},
    ]
    spec = {
        "clusterIP": "None",
        "publishNotReadyAddresses": True,
        "selector": selector(fleet_name, "stage"),
        "ports": ports,
    }
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(fleet, names.stage_service(fleet_name)),
        "spec": spec,
    }


def gateway_deployment(fleet: Mapping[str, Any], spec: ModelFleetSpec, serving: Placement) -> Obj:
    """The gateway: tokenizer from the model volume, CURVE keys to reach the heads of the
    ``serving`` revision (its plan; the template names it, so switching revisions rolls the
    gateway), API keys if given."""
    fleet_name, plan = fleet["metadata"]["name"], serving.plan
    labels = selector(fleet_name, "gateway")
    model_volume, _ = _model_volume(spec)
    mounts = [_plan_mount(), _model_mount(spec), _transport_mount(), _scratch_mount()]
    volumes = [
        _plan_volume(fleet_name, serving.revision),
        model_volume,
        _transport_volume(fleet_name),
        _scratch_volume(),
    ]
    env = [
        _env("MF_FLEET", fleet_name), _env("HOME", SCRATCH_DIR),
        _env("MF_PLAN", f"{names.PLAN_MOUNT_DIR}/{names.PLAN_KEY}"), _env("MF_GATEWAY_HOST", "0.0.0.0"),
        _env("MF_GATEWAY_PORT", str(names.GATEWAY_PORT)), _env("MF_KEYS_DIR", names.TRANSPORT_KEYS_DIR),
    ]  # fmt: skip
    if spec.gateway.api_keys_secret:
        mounts.append({"name": "api-keys", "mountPath": names.API_KEYS_DIR, "readOnly": True})
        secret = {
            "secretName": spec.gateway.api_keys_secret,
            "items": [{"key": names.API_KEYS_KEY, "path": names.API_KEYS_KEY}],
        }
        volumes.append({"name": "api-keys", "secret": secret})
        env.append(_env("MF_API_KEYS_FILE", f"{names.API_KEYS_DIR}/{names.API_KEYS_KEY}"))
    container = {
        "name": "gateway", "image": gateway_image(spec), "imagePullPolicy": spec.images.pull_policy,
        "command": ["modelfleet", "gateway"], "env": env, "volumeMounts": mounts,
        "ports": [{"name": "http", "containerPort": names.GATEWAY_PORT}],
        "readinessProbe": _probe("/readyz", names.GATEWAY_PORT, period=5),
        "livenessProbe": _probe("/healthz", names.GATEWAY_PORT, period=10),
        "securityContext": CONTAINER_SECURITY, "resources": _pod_resources(spec.gateway.resources),
    }  # fmt: skip
    template = {
        "metadata": {
            "labels": labels,
            "annotations": {
                names.ANNOTATION_PLAN_HASH: plan.plan_hash(),
                names.ANNOTATION_REVISION: serving.revision,
            },
        },
        "spec": _with_fetch(
            {
                "containers": [container],
                "volumes": volumes,
                "automountServiceAccountToken": False,
                "securityContext": POD_SECURITY,
            },
            spec,
            weights=False,  # the gateway reads the config, tokenizer and chat template
            resources=_pod_resources(spec.gateway.resources),
        ),
    }
    deployment_spec = {"replicas": spec.gateway.replicas, "selector": {"matchLabels": labels}, "template": template}
    meta = _metadata(fleet, names.gateway_name(fleet_name), "gateway")
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": deployment_spec}


def gateway_service(fleet: Mapping[str, Any], spec: ModelFleetSpec) -> Obj:
    fleet_name = fleet["metadata"]["name"]
    port = {"name": "http", "port": names.GATEWAY_PORT, "targetPort": "http"}
    service_spec = {"type": spec.gateway.service_type, "selector": selector(fleet_name, "gateway"), "ports": [port]}
    meta = _metadata(fleet, names.gateway_name(fleet_name), "gateway")
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": service_spec}


def endpoint(fleet: Mapping[str, Any]) -> str:
    meta = fleet["metadata"]
    return f"http://{names.gateway_name(meta['name'])}.{meta['namespace']}.svc:{names.GATEWAY_PORT}/v1"


def network_policies(fleet: Mapping[str, Any], spec: ModelFleetSpec) -> list[Obj]:
    """Stage pods accept anything from pods of their own fleet (frames, tensor collectives, the
    gateway) and their HTTP port (/status, /metrics) from the operator and the monitoring
    namespace only; the gateway's port is open to all (clients). Both reach only their own fleet,
    DNS and, for an hf:// model, the Hub's port (the fetch init container)."""
    fleet_name = fleet["metadata"]["name"]
    same_fleet = [{"podSelector": {"matchLabels": {names.LABEL_FLEET: fleet_name}}}]
    http = {"ports": [{"protocol": "TCP", "port": names.AGENT_HTTP_PORT}], "from": http_peers()}
    stages = {"podSelector": {"matchLabels": selector(fleet_name, "stage")}, "ingress": [{"from": same_fleet}, http]}
    clients = {"ports": [{"protocol": "TCP", "port": names.GATEWAY_PORT}]}
    gateway = {"podSelector": {"matchLabels": selector(fleet_name, "gateway")}, "ingress": [clients]}
    egress = [{"to": same_fleet}, {"ports": [{"protocol": p, "port": 53} for p in ("UDP", "TCP")]}]
    if (hub_port := _hub_port(spec)) is not None:
        egress.append({"ports": [{"protocol": "TCP", "port": hub_port}]})
    return [
        {
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": _metadata(fleet, f"{fleet_name}-{part}"),
            "spec": {**body, "policyTypes": ["Ingress", "Egress"], "egress": egress},
        }
        for part, body in (("stages", stages), ("gateway", gateway))
    ]  # fmt: skip


def http_peers() -> list[Obj]:
    """Who outside the fleet may read a stage's HTTP port: the operator's pods in its namespace
    (:data:`OPERATOR_NAMESPACE_ENV`), and the monitoring namespace's pods (those with
    :data:`MONITORING_POD_LABELS_ENV`'s labels, when set)."""
    operator_namespace = os.environ.get(OPERATOR_NAMESPACE_ENV) or DEFAULT_OPERATOR_NAMESPACE
    monitoring_namespace = os.environ.get(MONITORING_NAMESPACE_ENV) or DEFAULT_MONITORING_NAMESPACE
    return [
        _peer(operator_namespace, OPERATOR_POD_LABELS),
        _peer(monitoring_namespace, parse_labels(os.environ.get(MONITORING_POD_LABELS_ENV, ""))),
    ]


def _peer(namespace: str, labels: Mapping[str, str]) -> Obj:
    # kubernetes.io/metadata.name: the label every namespace carries (Kubernetes >= 1.22)
    return {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
        "podSelector": {"matchLabels": dict(labels)} if labels else {},
    }


def parse_labels(text: str) -> dict[str, str]:
    """``k=v,k=v`` (as ``kubectl -l`` takes equality selectors) as a dict; empty text, no labels."""
    labels = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(
                f"{MONITORING_POD_LABELS_ENV}: {item!r} is not key=value (e.g. app.kubernetes.io/name=prometheus)"
            )
        labels[key.strip()] = value.strip()
    return labels


def _hub_port(spec: ModelFleetSpec) -> int | None:
    """The TCP port an hf:// model is fetched from: ``model.endpoint``'s (or the operator's
    :data:`HF_ENDPOINT_ENV`), else HTTPS; None for volume-backed models."""
    if not spec.model.uri.startswith("hf://"):
        return None
    url = urllib.parse.urlsplit(spec.model.endpoint or os.environ.get(HF_ENDPOINT_ENV) or "https://huggingface.co")
    return url.port or (80 if url.scheme == "http" else 443)


def disruption_budget(fleet: Mapping[str, Any]) -> Obj:
    """At most one stage pod evicted at a time: a drain degrades one group, never all at once."""
    fleet_name = fleet["metadata"]["name"]
    spec = {"maxUnavailable": 1, "selector": {"matchLabels": selector(fleet_name, "stage")}}
    meta = _metadata(fleet, f"{fleet_name}-stages")
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": meta, "spec": spec}


def fleet_objects(
    fleet: Mapping[str, Any],
    spec: ModelFleetSpec,
    placement: Placement,
    running: Sequence[Placement] | None = None,
    serving: Placement | None = None,
    specs: Mapping[str, ModelFleetSpec | None] | None = None,
) -> list[Obj]:
    """Everything the operator applies for a fleet, in apply order (a plan before its readers):
    ``placement`` is the plan of the fleet's generation; in a rollout, ``running`` lists the
    revisions whose plans and pods are applied and ``serving`` the one the gateway points at
    (both default to ``placement``). ``specs`` gives, by revision, the spec a revision's pods are
    made from and its plan records (default ``spec``; None: made from ``spec``, nothing recorded)."""
    running, specs = running or [placement], specs or {}
    return [
        plan_config_map(fleet, placement),
        *(plan_config_map(fleet, p, revision_scoped=True, spec=specs.get(p.revision, spec)) for p in running),
        stage_service(fleet), *network_policies(fleet, spec), disruption_budget(fleet),
        *(stage_pod(fleet, specs.get(p.revision) or spec, p, member) for p in running for member in p.members),
        gateway_deployment(fleet, spec, serving or placement), gateway_service(fleet, spec),
    ]  # fmt: skip
