"""One reconcile pass of a ModelFleet: read, plan, apply, replace failed stages, report status.

Kubernetes is reached only through :class:`Cluster` (the real one in ``kube.py``, a dict in tests),
and kopf not at all: :func:`reconcile` returns an :class:`Outcome` that the thin handlers turn
into a status patch and ``kopf.PermanentError`` / ``kopf.TemporaryError``. A pass is idempotent:
objects are created when missing, merge-patched when they differ, and stage pods (immutable) are
deleted when their plan hash is stale, to be recreated on the next pass.

A plan is kept while the fleet's generation is the one it was made for and every planned node
still matches: nodes joining the cluster do not reshuffle a running fleet.

Revisions: a plan (or member nodes) that differs from the running one has another revision
(:func:`names.revision`), and so other pod names and its own plan ConfigMap; the two never form one
chain, since each revision's plan addresses only its own pods. A new revision is rolled out with a
surge (:mod:`.rollout`): its pods start beside the serving revision's, the gateway moves to it when
its chain is ready, and the old pods go once every gateway pod has moved; a surge not ready by
``rollout.progressDeadlineSeconds`` (counted from ``status.rolloutStartedAt``) is abandoned. Each
revision's plan ConfigMap records the spec its pods are made from, so a serving pod remade during a
rollout is made as it was. A spec change that leaves the plan as it was (the gateway's replicas,
say) keeps the revision and its pods.

Time is a parameter (``now``), never read from the operator's memory: tests pass a fixed clock.

This module is one reconcile pass and its helpers (over 400 lines): the pass reads like a list of
steps, and each step is a function below it.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import zmq

from modelfleet.plan import FleetPlan, PlanError
from modelfleet.planner import node_name

from . import names, objects, rollout
from .affinity import pod_terms
from .placement import Infeasible, MemberAssignment, Placement, place, rejection, shortfall
from .rollout import Step
from .spec import GROUP, KIND, VERSION, ModelFleetSpec, SpecError, parse_spec
from .status import (
    Condition,
    Phase,
    Reason,
    condition,
    member_phase,
    members,
    scheduled,
    set_condition,
    timestamp,
)
from .summary import SUMMARY_KEY, ModelSummary, summary_config_map_name

Obj = dict[str, Any]
SUMMARY_RETRY_SECONDS = 15.0
PLAN_RETRY_SECONDS = 60.0
ROLLOUT_POLL_SECONDS = 5.0  # while a rollout waits on readiness, which wakes no handler


class Cluster(Protocol):
    def list_nodes(self) -> list[Obj]: ...
    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Obj | None: ...
    def create(self, obj: Obj) -> None: ...
    def patch(self, obj: Obj) -> None: ...  # JSON merge patch of the object's own fields
    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None: ...
    def list_pods(self, namespace: str, labels: Mapping[str, str]) -> list[Obj]: ...
    def agent_status(self, pod: Obj) -> Obj | None: ...  # the agent's /status JSON; None if it does not answer


@dataclass
class Outcome:
    """The status to write, and whether to stop for good or try again after a delay."""

    status: dict[str, Any]
    permanent_error: str | None = None
    retry_after_seconds: float | None = None
    message: str = ""
    applied: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)  # failed stage pods deleted to be made anew


def reconcile(fleet: Mapping[str, Any], cluster: Cluster, now: dt.datetime | None = None) -> Outcome:
    """One pass at time ``now`` (default the clock): the conditions' times and a rollout's progress
    deadline are measured against it, never against the operator's memory."""
    meta, old = fleet["metadata"], dict(fleet.get("status") or {})
    generation = int(meta.get("generation") or 0)
    report = _Report(old, generation, now or dt.datetime.now(dt.UTC))
    if report.crash_looped():
        return Outcome(old, message="stopped: a stage exceeded restartPolicy.maxStageRestarts")
    try:
        spec = parse_spec(fleet.get("spec") or {})
        _check_name(meta["name"])
    except SpecError as exc:
        report.fail(Condition.READY, Reason.INVALID_SPEC, str(exc))
        return Outcome(report.status, permanent_error=str(exc))
    summary = _summary(fleet, spec, cluster, report)
    if summary is None:
        return Outcome(report.status, retry_after_seconds=SUMMARY_RETRY_SECONDS, message=report.last_message)
    serving, serving_spec = _serving_placement(fleet, cluster)
    target, no_room = _target(fleet, spec, summary, cluster, serving, serving_spec or spec)
    if isinstance(target, Infeasible):
        if serving is None:
            report.fail(Condition.PLANNED, Reason(target.reason), target.message, Phase.PENDING)
            return Outcome(report.status, retry_after_seconds=PLAN_RETRY_SECONDS, message=target.message)
        report.set(Condition.PLANNED, False, Reason(target.reason), target.message)
        why = f"no new plan fits; revision {serving.revision} keeps serving: {target.message}"
        report.set(Condition.PROGRESSING, False, Reason.ROLLOUT_FAILED, why)
        kept = {serving.revision: serving_spec}
        return _rollout(fleet, spec, cluster, report, Step.FAILED, serving, serving, kept, retry=PLAN_RETRY_SECONDS)
    _, notes = pod_terms(spec.placement.affinity, meta["name"], meta["namespace"])  # left to the scheduler
    planned = "; ".join([f"{len(target.members)} members on {_nodes(target)}", *notes])
    report.set(Condition.PLANNED, True, Reason.PLANNED, planned)
    step = _step(serving, target, no_room, report)
    if serving is not None and step == Step.REPLACE:
        report.replacing(serving, target, no_room)
    specs: dict[str, ModelFleetSpec | None] = {target.revision: spec}
    if serving is not None and serving.revision != target.revision:
        specs[serving.revision] = serving_spec  # its pods are remade as they were made
    return _rollout(fleet, spec, cluster, report, step, target, serving or target, specs)


def _rollout(
    fleet: Mapping[str, Any],
    spec: ModelFleetSpec,
    cluster: Cluster,
    report: _Report,
    step: Step,
    target: Placement,
    serving: Placement,
    specs: Mapping[str, ModelFleetSpec | None],
    retry: float | None = None,
) -> Outcome:
    """One pass of ``step``: abandon a surge past its deadline, replace failed stages, apply the
    revisions it runs (each made from its own spec, ``specs``), point the gateway, prune the pods
    of revisions it no longer keeps, report."""
    meta = fleet["metadata"]
    started = rollout.started_at(report.old, target.revision, report.now)
    if step == Step.SURGE and (late := _past_deadline(fleet, spec, cluster, report, (serving, target), started)):
        report.set(Condition.PROGRESSING, False, Reason.PROGRESS_DEADLINE_EXCEEDED, late)
        step = Step.FAILED
    running = {Step.STEADY: [target], Step.SURGE: [serving, target], Step.REPLACE: [target]}.get(step, [serving])
    crashes = _replace_failed_stages(fleet, spec, cluster, report, {p.revision for p in running})
    if step == Step.SURGE and target.revision in crashes:
        why = f"revision {target.revision} failed ({crashes.pop(target.revision)}); revision {serving.revision} keeps serving"
        report.set(Condition.PROGRESSING, False, Reason.ROLLOUT_FAILED, why)
        step, running = Step.FAILED, [serving]
    # a serving stage out of restarts while a new revision surges degrades the fleet: the new one replaces it
    degraded = crashes.pop(serving.revision, None) if step == Step.SURGE else None
    if crashes:
        report.fail(Condition.READY, Reason.STAGE_CRASH_LOOPING, next(iter(crashes.values())), Phase.FAILED)
        return Outcome(report.status, message=report.last_message, replaced=report.replaced)
    to = target if step in (Step.STEADY, Step.REPLACE) else serving
    if step == Step.SURGE:
        target_members, _ = _members(fleet, target, cluster)
        report.surging(serving, target, target_members)
        if all(m["phase"] == "Ready" for m in target_members):
            to = target  # the new chain is ready: the gateway moves to it
    gateway = cluster.get("apps/v1", "Deployment", meta["namespace"], names.gateway_name(meta["name"]))
    keep_others = step == Step.SURGE or (step == Step.STEADY and not rollout.gateway_settled(gateway))
    _ensure_transport_keys(fleet, cluster)
    desired = objects.fleet_objects(fleet, spec, target, running, to, specs)
    if target is serving and step == Step.FAILED:  # no plan for this generation: keep the record unplanned
        desired = [o for o in desired if o["metadata"]["name"] != names.plan_config_map(meta["name"])]
    applied = [f"{obj['kind']}/{obj['metadata']['name']}: {apply(cluster, obj)}" for obj in desired]
    pruned, leaving = _prune_stage_pods(fleet, cluster, desired, {p.revision for p in running}, keep_others)
    report.observe(fleet, to, cluster)
    if degraded is not None and to is serving:
        report.serving_crashed(serving, target, degraded)
    moving = step == Step.SURGE or bool(leaving)
    if step == Step.STEADY:
        report.settled(target, leaving)
    report.fields["updateRevision"] = None if to is target else target.revision
    surging = step == Step.SURGE and to is not target
    report.fields["rolloutStartedAt"] = timestamp(started) if surging else None
    retry = retry if retry is not None else ROLLOUT_POLL_SECONDS if moving else None
    return Outcome(
        report.status,
        retry_after_seconds=retry,
        message=report.last_message,
        applied=applied + pruned,
        replaced=report.replaced,
    )


def _past_deadline(
    fleet: Mapping[str, Any],
    spec: ModelFleetSpec,
    cluster: Cluster,
    report: _Report,
    revisions: tuple[Placement, Placement],
    started: dt.datetime,
) -> str | None:
    """Why the surge of the second of ``revisions`` (serving, target) is abandoned: some member is
    not Ready ``rollout.progressDeadlineSeconds`` after it ``started``; None while in time."""
    (serving, target), deadline = revisions, spec.rollout.progress_deadline_seconds
    if not rollout.overdue(started, report.now, deadline):
        return None
    waiting = rollout.not_ready(*_members(fleet, target, cluster))
    if not waiting:
        return None
    elapsed = int((report.now - started).total_seconds())
    return (
        f"revision {target.revision} was not ready {elapsed} s after its rollout began at {timestamp(started)}"
        f" (rollout.progressDeadlineSeconds={deadline}); not ready: {', '.join(waiting)};"
        f" revision {serving.revision} keeps serving"
    )


def _step(serving: Placement | None, target: Placement, no_room: str, report: _Report) -> Step:
    if serving is None or serving.revision == target.revision:
        return Step.STEADY
    if report.rollout_failed(target.revision):
        return Step.FAILED
    return Step.REPLACE if no_room else Step.SURGE


def _target(
    fleet: Mapping[str, Any],
    spec: ModelFleetSpec,
    summary: ModelSummary,
    cluster: Cluster,
    serving: Placement | None,
    serving_spec: ModelFleetSpec,
) -> tuple[Placement | Infeasible, str]:
    """The plan of this generation: the applied one while it holds, else a new one: planned on the
    whole nodes when it fits beside the serving revision's members (made from ``serving_spec``),
    else planned on what they leave free, else the first with why there was no room for both (""
    when there was, or nothing serves)."""
    if (kept := _current_placement(fleet, spec, cluster)) is not None:
        return kept, ""
    meta, nodes = fleet["metadata"], cluster.list_nodes()
    whole = place(spec, summary, nodes, meta["name"], meta["namespace"])
    if serving is None or isinstance(whole, Infeasible) or whole.revision == serving.revision:
        return whole, ""
    pods = {
        p["metadata"]["name"]: p for p in cluster.list_pods(meta["namespace"], objects.selector(meta["name"], "stage"))
    }
    repelled = rollout.repelled_nodes(spec, meta["name"], meta["namespace"], serving, whole)
    free = [
        n for n in rollout.free_nodes(nodes, meta["name"], serving, pods, serving_spec) if node_name(n) not in repelled
    ]
    shared = sorted({m.node for m in whole.members} & repelled.keys())
    if (why := f"{shared[0]}: {repelled[shared[0]]}" if shared else shortfall(whole, spec, free)) is None:
        return whole, ""
    beside = place(spec, summary, free, meta["name"], meta["namespace"])  # other nodes, or other layer ranges
    if isinstance(beside, Placement):
        return beside, ""
    return whole, f"beside revision {serving.revision}'s members: {why}"


def _check_name(fleet_name: str) -> None:
    """The CRD's rule on metadata.name, for fleets stored before it."""
    if len(fleet_name) > names.MAX_FLEET_NAME_LENGTH:
        raise SpecError(
            f"metadata.name={fleet_name!r} has {len(fleet_name)} characters, at most {names.MAX_FLEET_NAME_LENGTH}:"
            " stage pod names add a revision and indices and must stay DNS labels (63)"
        )


def wake_up(pod_meta: Mapping[str, Any]) -> Obj:
    """A patch that marks the failed stage pod on its fleet: an update that runs reconcile now.
    The value names the pod's uid, so repeated events for one failure patch nothing new."""
    fleet = {"name": pod_meta["labels"][names.LABEL_FLEET], "namespace": pod_meta["namespace"]}
    failed = f"{pod_meta['name']}/{pod_meta.get('uid', '')}"
    metadata = {**fleet, "annotations": {names.ANNOTATION_STAGE_FAILED: failed}}
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "metadata": metadata}


def _ensure_transport_keys(fleet: Mapping[str, Any], cluster: Cluster) -> None:
    """The fleet's CURVE key pair, made once: a new pair would cut running agents off each other."""
    meta = fleet["metadata"]
    if cluster.get("v1", "Secret", meta["namespace"], names.transport_secret(meta["name"])) is None:
        public, secret = zmq.curve_keypair()
        cluster.create(objects.transport_secret(fleet, public.decode(), secret.decode()))


def _nodes(placement: Placement) -> str:
    return ", ".join(sorted({m.node for m in placement.members}))


def _summary(fleet: Mapping[str, Any], spec: ModelFleetSpec, cluster: Cluster, report: _Report) -> ModelSummary | None:
    """The summary from its ConfigMap (given, or copied from an inspection); None while there is none.

    A ConfigMap labelled for another model (the spec's model changed) is not used."""
    meta = fleet["metadata"]
    name = summary_config_map_name(meta["name"])
    config_map = cluster.get("v1", "ConfigMap", meta["namespace"], name) or {}
    model = (config_map.get("metadata", {}).get("labels") or {}).get(names.LABEL_MODEL)
    current = model in (None, names.model_key(spec.model.uri))
    text = (config_map.get("data") or {}).get(SUMMARY_KEY) if current else None
    if text is None and (text := _inspect(fleet, spec, cluster, report)) is not None:
        apply(cluster, objects.summary_config_map(fleet, spec, text))
    if text is None:
        return None
    try:
        summary = ModelSummary.from_json(text)
    except PlanError as exc:
        report.fail(Condition.MODEL_INSPECTED, Reason.INVALID_MODEL_SUMMARY, f"ConfigMap {name}: {exc}", Phase.PENDING)
        return None
    report.set(Condition.MODEL_INSPECTED, True, Reason.SUMMARY_FOUND, f"{summary.family}, {summary.num_layers} layers")
    return summary


def _inspect(fleet: Mapping[str, Any], spec: ModelFleetSpec, cluster: Cluster, report: _Report) -> str | None:
    """Start the inspection Job, or return the summary its pod reported; None until it has."""
    meta = fleet["metadata"]
    wanted = f"ConfigMap {summary_config_map_name(meta['name'])} with key {SUMMARY_KEY}"
    job = objects.inspection_job(fleet, spec)
    if cluster.get("batch/v1", "Job", meta["namespace"], job["metadata"]["name"]) is None:
        cluster.create(job)  # a Job's template is immutable: never patched, a new model gets a new Job
    labels = job["spec"]["template"]["metadata"]["labels"]
    reports = {p["metadata"]["name"]: (p.get("status") or {}) for p in cluster.list_pods(meta["namespace"], labels)}
    for status in reports.values():
        if status.get("phase") == "Succeeded" and (reported := _termination_message(status)):
            return reported
    failed = {name: _termination_message(s) for name, s in reports.items() if s.get("phase") == "Failed"}
    if failed:
        detail = "; ".join(f"pod {name}: {why or 'no message'}" for name, why in sorted(failed.items()))
        report.fail(Condition.MODEL_INSPECTED, Reason.INSPECTION_FAILED, detail, Phase.PENDING)
    else:
        waiting = f"Job {job['metadata']['name']} reads the checkpoint's headers, or provide {wanted}"
        report.fail(Condition.MODEL_INSPECTED, Reason.INSPECTING, waiting, Phase.PENDING)
    return None


def _running(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") == "Running" and not pod["metadata"].get("deletionTimestamp")


def _termination_message(pod_status: Mapping[str, Any]) -> str | None:
    for container in pod_status.get("containerStatuses") or []:
        message = ((container.get("state") or {}).get("terminated") or {}).get("message")
        if message:
            return str(message)
    return None


def _current_placement(fleet: Mapping[str, Any], spec: ModelFleetSpec, cluster: Cluster) -> Placement | None:
    """The applied plan when it was made for this generation and its nodes still match."""
    meta = fleet["metadata"]
    config_map = cluster.get("v1", "ConfigMap", meta["namespace"], names.plan_config_map(meta["name"]))
    annotations = ((config_map or {}).get("metadata") or {}).get("annotations") or {}
    if config_map is None or annotations.get(names.ANNOTATION_GENERATION) != str(meta.get("generation") or 0):
        return None
    placement = _placement_in(config_map)
    if placement is None:
        return None
    nodes = {(n.get("metadata") or {}).get("name"): n for n in cluster.list_nodes()}
    if any(m.node not in nodes or rejection(nodes[m.node], spec) is not None for m in placement.members):
        return None
    return placement


def _serving_placement(fleet: Mapping[str, Any], cluster: Cluster) -> tuple[Placement | None, ModelFleetSpec | None]:
    """The revision the gateway points at, from that revision's plan, and the spec its pods are
    made from; None before there is one (the spec is None too when its plan records none)."""
    meta = fleet["metadata"]
    gateway = cluster.get("apps/v1", "Deployment", meta["namespace"], names.gateway_name(meta["name"]))
    revision = rollout.serving_revision(gateway)
    if revision is None:
        return None, None
    name = names.revision_plan_config_map(meta["name"], revision)
    config_map = cluster.get("v1", "ConfigMap", meta["namespace"], name)
    if config_map is None:
        return None, None
    return _placement_in(config_map), _spec_in(config_map)


def _spec_in(config_map: Mapping[str, Any]) -> ModelFleetSpec | None:
    """The spec a revision's plan records; None when it records none (written before there was
    a record) or one that no longer parses."""
    text = (config_map.get("data") or {}).get(names.SPEC_KEY)
    if text is None:
        return None
    try:
        return parse_spec(json.loads(text))
    except ValueError:  # SpecError and JSONDecodeError both are
        return None


def _placement_in(config_map: Mapping[str, Any]) -> Placement | None:
    """The plan and members a plan ConfigMap holds; None when another version wrote it or a hand edited it."""
    revision = (config_map["metadata"].get("annotations") or {}).get(names.ANNOTATION_REVISION)
    try:
        plan = FleetPlan.from_json(config_map["data"][names.PLAN_KEY])
        assigned = tuple(MemberAssignment(**m) for m in json.loads(config_map["data"][names.MEMBERS_KEY]))
    except (KeyError, TypeError, ValueError):
        return None
    return Placement(plan, assigned, revision) if revision else None


def apply(cluster: Cluster, obj: Obj) -> str:
    """Create ``obj``, or bring the live object to it; returns what was done."""
    meta = obj["metadata"]
    live = cluster.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
    if live is None:
        cluster.create(obj)
        return "created"
    if obj["kind"] == "Pod":  # a pod's spec is immutable: replace it when its plan changed
        if live["metadata"].get("deletionTimestamp"):
            return "terminating"
        live_hash = (live["metadata"].get("annotations") or {}).get(names.ANNOTATION_PLAN_HASH)
        if live_hash != meta["annotations"][names.ANNOTATION_PLAN_HASH]:
            cluster.delete("v1", "Pod", meta["namespace"], meta["name"])
            return "deleted (stale plan)"
        return "unchanged"
    if _contains(live, obj):
        return "unchanged"
    cluster.patch(obj)
    return "patched"


def _contains(live: Any, desired: Any) -> bool:
    """Every field of ``desired`` is in ``live`` with the same value (the server may add more)."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(k in live and _contains(live[k], v) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(live, list) and len(live) == len(desired) and all(map(_contains, live, desired))
    return bool(live == desired)


def _prune_stage_pods(
    fleet: Mapping[str, Any], cluster: Cluster, desired: list[Obj], running: set[str], keep_others: bool
) -> tuple[list[str], set[str]]:
    """Delete the stage pods of revisions that no longer run (with their plans), and those the plan
    no longer has (fewer replicas), except, with ``keep_others``, other revisions' pods: the gateway
    may still use them. Returns what was done and the revisions whose pods were kept so."""
    meta = fleet["metadata"]
    wanted = {o["metadata"]["name"] for o in desired if o["kind"] == "Pod"}
    pruned, kept, gone = [], set(), set()
    for pod in cluster.list_pods(meta["namespace"], objects.selector(meta["name"], "stage")):
        name, revision = pod["metadata"]["name"], (pod["metadata"].get("labels") or {}).get(names.LABEL_REVISION, "")
        if name in wanted or pod["metadata"].get("deletionTimestamp"):
            continue
        if keep_others and revision not in running:
            kept.add(revision)
            continue
        cluster.delete("v1", "Pod", meta["namespace"], name)
        pruned.append(f"Pod/{name}: deleted (not in the plan)")
        gone.add(revision)
    for revision in sorted(gone - running - {""}):
        cluster.delete("v1", "ConfigMap", meta["namespace"], names.revision_plan_config_map(meta["name"], revision))
        pruned.append(f"ConfigMap/{names.revision_plan_config_map(meta['name'], revision)}: deleted (revision gone)")
    return pruned, kept


def _replace_failed_stages(
    fleet: Mapping[str, Any], spec: ModelFleetSpec, cluster: Cluster, report: _Report, revisions: set[str]
) -> dict[str, str]:
    """Delete the failed stage pods of ``revisions`` (recreated by apply), counting; a stage out of
    restarts is left as it is. Returns, by revision, why one of its stages is out of restarts."""
    meta, limit = fleet["metadata"], spec.restart_policy.max_stage_restarts
    crashed: dict[str, str] = {}
    for pod in cluster.list_pods(meta["namespace"], objects.selector(meta["name"], "stage")):
        name, revision = pod["metadata"]["name"], (pod["metadata"].get("labels") or {}).get(names.LABEL_REVISION, "")
        if revision not in revisions or member_phase(pod) != "Failed" or pod["metadata"].get("deletionTimestamp"):
            continue
        restarts = report.restarts.get(name, 0)
        if restarts >= limit:
            why = f"stage pod {name} failed after {restarts} replacements (restartPolicy.maxStageRestarts={limit})"
            crashed.setdefault(revision, why)
            continue
        cluster.delete("v1", "Pod", meta["namespace"], name)
        report.restarts[name] = restarts + 1
        report.replaced.append(name)
    return crashed


class _Report:
    """The status being written: conditions, phase and the rest, starting from the live status."""

    def __init__(self, old: Mapping[str, Any], generation: int, now: dt.datetime):
        restarts = dict(old.get("stageRestarts") or {}) if old.get("observedGeneration") == generation else {}
        self.generation, self.old, self.now = generation, old, now
        self.conditions: list[dict[str, Any]] = list(old.get("conditions") or [])
        self.restarts: dict[str, int] = restarts  # a new generation starts its count afresh
        self.fields: dict[str, Any] = {"phase": str(Phase.PLANNING)}
        self.last_message = ""
        self.replaced: list[str] = []

    def crash_looped(self) -> bool:
        ready = condition(self.conditions, Condition.READY) or {}
        return (
            ready.get("reason") == Reason.STAGE_CRASH_LOOPING and self.old.get("observedGeneration") == self.generation
        )

    def set(self, kind: Condition, ok: bool, reason: Reason, message: str) -> None:
        self.conditions = set_condition(self.conditions, kind, ok, reason, message, self.generation, self.now)
        self.last_message = message

    def fail(self, kind: Condition, reason: Reason, message: str, phase: Phase = Phase.FAILED) -> None:
        self.set(kind, False, reason, message)
        if kind != Condition.READY:
            self.set(Condition.READY, False, reason, message)
        self.fields["phase"] = str(phase)

    @property
    def status(self) -> dict[str, Any]:
        return {
            **self.fields,
            "observedGeneration": self.generation,
            "conditions": self.conditions,
            "stageRestarts": self.restarts,
        }

    def flag(self, kind: Condition, ok: bool, if_true: Reason, if_false: Reason, message: str) -> None:
        self.set(kind, ok, if_true if ok else if_false, message)

    def rollout_failed(self, revision: str) -> bool:
        """Whether this generation's rollout of ``revision`` failed or ran out of time (it stays
        stopped until the next)."""
        progressing = condition(self.conditions, Condition.PROGRESSING) or {}
        return (
            progressing.get("reason") in (Reason.ROLLOUT_FAILED, Reason.PROGRESS_DEADLINE_EXCEEDED)
            and progressing.get("observedGeneration") == self.generation
            and f"revision {revision} " in str(progressing.get("message"))
        )

    def replacing(self, serving: Placement, target: Placement, no_room: str) -> None:
        old, new = serving.revision, target.revision
        message = f"revision {new} replaces revision {old} without a surge, so the fleet does not serve until it loads: no room {no_room}"
        self.set(Condition.PROGRESSING, True, Reason.ROLLOUT_WITHOUT_SURGE, message)

    def surging(self, serving: Placement, target: Placement, target_members: list[dict[str, Any]]) -> None:
        ready = sum(m["phase"] == "Ready" for m in target_members)
        old, new = serving.revision, target.revision
        message = f"revision {new}: {ready}/{len(target_members)} members ready beside revision {old}, which serves"
        if ready == len(target_members):
            message = f"revision {new} is ready: the gateway moves to it from revision {old}"
        self.set(Condition.PROGRESSING, True, Reason.ROLLING_OUT, message)

    def serving_crashed(self, serving: Placement, target: Placement, why: str) -> None:
        """A serving stage is out of restarts while ``target`` surges: degraded, not failed, since
        the rollout goes on and the gateway leaves the broken revision once the new one is ready."""
        message = (
            f"revision {serving.revision}: {why}; the rollout to revision {target.revision} goes on and replaces it"
        )
        self.set(Condition.READY, False, Reason.SERVING_STAGE_CRASH_LOOPING, message)
        self.fields["phase"] = str(Phase.DEGRADED)

    def settled(self, target: Placement, leaving: Collection[str]) -> None:
        """The gateway points at ``target``: the rollout ends once the old pods are gone."""
        progressing = condition(self.conditions, Condition.PROGRESSING)
        if leaving:
            message = f"the gateway moves to revision {target.revision}; the pods of revision {', '.join(sorted(leaving))} go once every gateway pod runs it"
            self.set(Condition.PROGRESSING, True, Reason.ROLLING_OUT, message)
        elif progressing is not None and (
            progressing.get("reason") == Reason.ROLLING_OUT or self.fields.get("phase") == Phase.READY
        ):  # a surge ends when the old pods are gone; a replacement or a failure, once the fleet serves
            self.set(Condition.PROGRESSING, True, Reason.ROLLOUT_COMPLETE, f"revision {target.revision} serves")

    def observe(self, fleet: Mapping[str, Any], placement: Placement, cluster: Cluster) -> None:
        """Members, readiness conditions and the summary phase from the pods and the gateway."""
        meta = fleet["metadata"]
        listed, pods = _members(fleet, placement, cluster)
        total, groups = len(listed), len(placement.plan.groups)
        ready_groups = sum(all(m["phase"] == "Ready" for m in listed if m["group"] == g) for g in range(groups))
        gateway = cluster.get("apps/v1", "Deployment", meta["namespace"], names.gateway_name(meta["name"])) or {}
        gateway_replicas = int((gateway.get("status") or {}).get("readyReplicas") or 0)
        on_nodes = sum(scheduled(pods.get(m["pod"])) for m in listed)
        loaded = sum(m["phase"] == "Ready" for m in listed)
        ready = ready_groups == groups and gateway_replicas >= 1
        some = Reason.SOME_GROUPS_READY if ready_groups else Reason.NO_GROUP_READY
        flags = [
            (Condition.SCHEDULED, on_nodes == total, Reason.PODS_SCHEDULED, Reason.PODS_PENDING, f"{on_nodes}/{total} stage pods on their nodes"),
            (Condition.WEIGHTS_LOADED, loaded == total, Reason.ALL_LAYERS_LOADED, Reason.LAYERS_LOADING, f"{loaded}/{total} members loaded"),
            (Condition.CHAIN_READY, ready_groups == groups, Reason.ALL_GROUPS_READY, some, f"{ready_groups}/{groups} groups ready"),
            (Condition.GATEWAY_READY, gateway_replicas >= 1, Reason.GATEWAY_AVAILABLE, Reason.GATEWAY_UNAVAILABLE, f"{gateway_replicas} gateway replicas ready"),
            (Condition.READY, ready, Reason.FLEET_READY, Reason.FLEET_NOT_READY, "serving" if ready else "not serving yet"),
        ]  # fmt: skip
        for kind, ok, if_true, if_false, message in flags:
            self.flag(kind, ok, if_true, if_false, message)
        phase = Phase.READY if ready else Phase.DEGRADED if ready_groups else Phase.LOADING
        self.fields.update(
            phase=str(phase), members=listed, ready=f"{loaded}/{total}", stages=len(placement.plan.groups[0].stages),
            replicas=ready_groups, selector=",".join(f"{k}={v}" for k, v in objects.selector(meta["name"], "stage").items()),
            endpoint=objects.endpoint(fleet), planHash=placement.plan.plan_hash(), revision=placement.revision,
        )  # fmt: skip


def _members(
    fleet: Mapping[str, Any], placement: Placement, cluster: Cluster
) -> tuple[list[dict[str, Any]], dict[str, Obj]]:
    """The status members of ``placement`` (phases from the agents' /status where they answer) and its pods by name."""
    meta = fleet["metadata"]
    stage_pods = cluster.list_pods(
        meta["namespace"], {**objects.selector(meta["name"], "stage"), names.LABEL_REVISION: placement.revision}
    )
    pods = {p["metadata"]["name"]: p for p in stage_pods}
    agents = {name: a for name, pod in pods.items() if _running(pod) and (a := cluster.agent_status(pod)) is not None}
    return members(meta["name"], placement, pods, agents), pods
