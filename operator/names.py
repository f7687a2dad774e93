"""Names shared by the planner, the object builders and the handlers: one definition each.

Pod names carry the fleet's revision (``<fleet>-<revision>-g<group>-s<stage>``, ``-r<rank>`` when
a stage has several tensor-parallel ranks). Within a revision they are stable, so a replaced pod
keeps its DNS name under the headless Service (``<pod>.<fleet>-stages.<namespace>.svc``) and the
plan's addresses stay true; across revisions they differ, so the stages of a new plan dial only
each other and never join a chain with a stage of the old one.
"""

from __future__ import annotations

import hashlib

from modelfleet.plan import stage_at

LABEL_FLEET = "modelfleet.io/fleet"
LABEL_GROUP = "modelfleet.io/group"
LABEL_STAGE_INDEX = "modelfleet.io/stage-index"
LABEL_TP_RANK = "modelfleet.io/tp-rank"
LABEL_REVISION = "modelfleet.io/revision"  # names.revision of the plan the pod runs
LABEL_COMPONENT = "modelfleet.io/component"  # stage | gateway | inspect
LABEL_MODEL = "modelfleet.io/model"  # names.model_key of the model URI, on inspection Jobs and summaries
ANNOTATION_PLAN_HASH = "modelfleet.io/plan-hash"
ANNOTATION_REVISION = "modelfleet.io/revision"
ANNOTATION_GENERATION = "modelfleet.io/generation"
ANNOTATION_STAGE_FAILED = "modelfleet.io/stage-failed"  # on a fleet: <pod>/<uid> of its last failed stage

AGENT_PORT = 5555  # every stage pod's frame port (each pod is a host of its own): the plan's addresses
_AGENT = stage_at(f"stage:{AGENT_PORT}")  # its other ports are the plan's (modelfleet.plan.StagePlan)
AGENT_HTTP_PORT = _AGENT.http_port  # /healthz, /readyz, /status, /metrics
TENSOR_PORT = _AGENT.rendezvous_port  # rank 0 of a stage with tp_size > 1 hosts its tensor group's rendezvous here
GATEWAY_PORT = 8000
PLAN_MOUNT_DIR = "/etc/modelfleet"
MODEL_MOUNT_DIR = "/models"
TRANSPORT_KEYS_DIR = "/etc/modelfleet-transport"  # fleet.key, fleet.key_secret (CURVE), as agents load them
API_KEYS_DIR = "/etc/modelfleet-api-keys"
API_KEYS_KEY = "api-keys"  # the key of spec.gateway.apiKeysSecret: bearer keys, one per line
PLAN_KEY = "plan.json"
MEMBERS_KEY = "members.json"
SPEC_KEY = "spec.json"  # in a revision's plan: the fleet spec its stage pods are made from


REVISION_LENGTH = 10  # hex digits
# <fleet>-<revision>-gGG-sSS-rRR stays a DNS label (63) with up to 99 groups, stages and ranks
MAX_FLEET_NAME_LENGTH = 63 - len("-0123456789-g99-s99-r99")


def revision(plan_hash: str, members: str) -> str:
    """The short revision of a plan (hashed with its addresses left out) and its member nodes:
    a change of either rolls out new pods under new names."""
    return hashlib.sha256(f"{plan_hash}\n{members}".encode()).hexdigest()[:REVISION_LENGTH]


def pod_name(fleet: str, revision: str, group: int, stage: int, tp_rank: int = 0, tp_size: int = 1) -> str:
    base = f"{fleet}-{revision}-g{group}-s{stage}"
    return f"{base}-r{tp_rank}" if tp_size > 1 else base


def stage_service(fleet: str) -> str:
    return f"{fleet}-stages"


def plan_config_map(fleet: str) -> str:
    """The plan of the fleet's current generation (the operator's record; no pod mounts it)."""
    return f"{fleet}-plan"


def revision_plan_config_map(fleet: str, revision: str) -> str:
    """The plan that one revision's stage pods mount, and the gateway while it serves that revision."""
    return f"{fleet}-plan-{revision}"


def model_key(uri: str) -> str:
    """A label-safe key of a model URI: inspection Jobs and summaries of another model never match."""
    return hashlib.sha256(uri.encode()).hexdigest()[:12]


def inspection_job(fleet: str, uri: str) -> str:
    return f"{fleet}-inspect-{model_key(uri)}"


def gateway_name(fleet: str) -> str:
    return f"{fleet}-gateway"


def stage_address(fleet: str, namespace: str, revision: str, group: int, stage: int, tp_size: int = 1) -> str:
    """host:port of a stage's rank 0, through the headless Service's per-pod DNS record."""
    return f"{pod_name(fleet, revision, group, stage, 0, tp_size)}.{stage_service(fleet)}.{namespace}.svc:{AGENT_PORT}"


def transport_secret(fleet: str) -> str:
    return f"{fleet}-transport"


def model_path(uri: str) -> str:
    """Where a pod finds the checkpoint: the plan's ``model.path`` inside the fleet's pods.

    pvc://CLAIM/PATH mounts the claim at MODEL_MOUNT_DIR, hostpath:///PATH mounts PATH there;
    hf://ORG/NAME[@REV] is fetched into ORG/NAME[@REV] under MODEL_MOUNT_DIR (a cache claim may
    hold several models and revisions side by side)."""
    if uri.startswith("pvc://"):
        return f"{MODEL_MOUNT_DIR}/{uri.removeprefix('pvc://').partition('/')[2]}"
    if uri.startswith("hostpath://"):
        return MODEL_MOUNT_DIR
    return f"{MODEL_MOUNT_DIR}/{uri.removeprefix('hf://')}"
