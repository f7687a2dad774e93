"""End to end: the kopf operator reconciles a ModelFleet against kmock's Kubernetes emulator, or
against a real cluster when ``$KUBECONFIG`` is set (the ``cluster`` fixture has both; tests that need
the emulator's request log or must write a pod's status skip on a real cluster).

kmock 0.8 lacks parts of the API (see shared FACTS); ``Emulator`` is the thin test-only layer
that adds them: uid, resourceVersion, generation (raised by a change of ``spec``) and
creationTimestamp on writes, the namespace from the URL, ``kind`` on lists, label selectors on
lists, and the garbage collector's part: deleting an object deletes the objects whose
ownerReferences name its uid, as kube-controller-manager does. It also logs every request as
(user agent, verb, resource, namespace) for the RBAC check. It uses kmock's private hooks, so
kmock is pinned to 0.8. The emulator serves from its own thread and event loop, kopf (through
KopfRunner) from another, and the test drives both through the real ``kubernetes`` client.

Every kopf test ends by checking that each request the operator made (user agent
``modelfleet-operator`` or ``kopf``) is allowed by the Helm chart's RBAC rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import itertools
import json
import os
import re
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kmock
import kopf
import pytest
import yaml
from fleet_fixtures import fleet, node, summary, summary_config_map
from kmock._internal import enums
from kopf.testing import KopfRunner

ROOT = Path(__file__).parents[1]
REAL_KUBECONFIG = os.environ.get("KUBECONFIG")  # as the session found it, before a test points it at kmock
TEST_USER_AGENT = "modelfleet-tests"
KINDS = {
    "v1/nodes": "Node", "v1/namespaces": "Namespace", "v1/pods": "Pod", "v1/services": "Service",
    "v1/configmaps": "ConfigMap", "v1/secrets": "Secret", "v1/events": "Event", "batch/v1/jobs": "Job", "apps/v1/deployments": "Deployment",
    "networking.k8s.io/v1/networkpolicies": "NetworkPolicy", "policy/v1/poddisruptionbudgets": "PodDisruptionBudget",
}  # fmt: skip
CLUSTER_SCOPED = {"v1/nodes", "v1/namespaces"}
VERBS = {"get", "list", "watch", "create", "patch", "delete"}


@dataclass(frozen=True)
class Request:
    user_agent: str
    verb: str  # the RBAC verb: get, list, watch, create, patch, update, delete, deletecollection
    group: str
    resource: str  # plural, with the subresource: modelfleets/status
    namespace: str | None  # None: cluster-wide


VERB_OF_ACTION = {
    enums.action.FETCH: "get", enums.action.LIST: "list", enums.action.WATCH: "watch",
    enums.action.CREATE: "create", enums.action.UPDATE: "patch", enums.action.DELETE: "delete",
}  # fmt: skip


class Emulator(kmock.KubernetesEmulator):
    _versions = itertools.count(1)
    log: list[Request]  # set by the fixture

    async def _handle(self, request: Any) -> Any:
        self._record(request)
        writes = (enums.action.CREATE, enums.action.UPDATE)
        if request.resource is not None and request.action in writes and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            if request.action == enums.action.CREATE:
                if request.namespace:
                    meta["namespace"] = request.namespace
                created = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                meta.update(uid=str(uuid.uuid4()), generation=1, creationTimestamp=created)
            elif "spec" in request.data and request.subresource is None and (live := self._live(request)):
                meta["generation"] = int(live.get("metadata", {}).get("generation") or 0) + 1
            meta["resourceVersion"] = str(next(self._versions))
        before = self._live(request) if request.name else None
        try:
            return await super()._handle(request)
        finally:
            if before is not None and self._live(request) is None:  # gone now: collect its dependents
                await self._collect(before["metadata"].get("uid"))

    def _live(self, request: Any) -> dict[str, Any] | None:
        key = (request.resource, request.namespace, request.name)
        if key not in self._objects:  # an ObjectsArray has no get()
            return None
        obj = self._objects[key]
        return None if obj.deleted else obj.raw

    async def _collect(self, owner_uid: str | None) -> None:
        """Delete what ``owner_uid`` owns, and what that owns: the garbage collector's background cascade."""
        if not owner_uid:
            return
        async with self._lock:
            owned = [
                (key, obj) for key, obj in self._objects.items()
                if not obj.deleted and any(ref.get("uid") == owner_uid for ref in obj.raw["metadata"].get("ownerReferences") or [])
            ]  # fmt: skip
            for (resource, _, _), obj in owned:
                raw = obj.raw
                obj.delete()
                await self._buses[resource].put({"type": "DELETED", "object": raw})
        for _, obj in owned:
            await self._collect(obj.last.raw["metadata"].get("uid"))

    def _record(self, request: Any) -> None:
        if request.resource is None or request.resource.plural is None or request.action is None:
            return  # discovery: no RBAC rule needed
        verb = VERB_OF_ACTION[request.action]
        if request.action == enums.action.UPDATE and request.method == enums.method.PUT:
            verb = "update"
        if request.action == enums.action.DELETE and request.name is None:
            verb = "deletecollection"
        plural = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
        agent = request.headers.get("User-Agent", "")
        self.log.append(Request(agent, verb, request.resource.group or "", plural, request.namespace))

    async def _serve_list(self, request: Any) -> Any:
        result = await super()._serve_list(request)
        resource = request.resource
        result["kind"] = f"{self.resources[resource].kind}List"
        result["apiVersion"] = f"{resource.group}/{resource.version}" if resource.group else resource.version
        if selector := request.params.get("labelSelector"):
            wanted = dict(term.split("=", 1) for term in selector.split(","))
            result["items"] = [
                o for o in result["items"] if wanted.items() <= (o["metadata"].get("labels") or {}).items()
            ]
        return result


@contextlib.contextmanager
def emulator() -> Iterator[tuple[str, list[Request]]]:
    """The emulator's URL and request log while it serves from a thread of its own."""
    started, stop, found = threading.Event(), threading.Event(), {}
    log: list[Request] = []

    async def serve() -> None:
        async with Emulator() as emulator, kmock.Server(emulator) as server:
            emulator.log = log
            for resource, kind in KINDS.items():
                emulator.resources[resource] = kmock.ResourceInfo(
                    namespaced=resource not in CLUSTER_SCOPED, kind=kind, verbs=VERBS
                )
            emulator.resources["modelfleet.io/v1alpha1/modelfleets"] = kmock.ResourceInfo(
                namespaced=True, kind="ModelFleet", singular="modelfleet", subresources={"status"}, verbs=VERBS
            )
            found["url"] = str(server.url).rstrip("/")
            started.set()
            while not stop.is_set():
                await asyncio.sleep(0.02)

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    assert started.wait(10), "the emulator did not start"
    try:
        yield found["url"], log
    finally:
        stop.set()
        thread.join(10)


@dataclass
class Site:
    """Where a scenario runs: the API through the test's own client, the fleet's namespace, and
    the emulator's request log (None on a real cluster)."""

    api: Any  # modelfleet.operator.kube.KubeCluster
    namespace: str
    log: list[Request] | None
    kopf_args: list[str] = field(default_factory=list)

    def needs_emulator(self, why: str) -> None:
        if self.log is None:
            pytest.skip(f"needs the emulator: {why}")

    def operator_requests(self) -> list[Request]:
        assert self.log is not None
        return [r for r in self.log if r.user_agent.startswith(("modelfleet-operator/", "kopf/"))]


@pytest.fixture(params=["kmock", "kubeconfig"])
def site(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Site]:
    """The emulator, or the cluster of ``$KUBECONFIG`` (skipped when unset) in a namespace of its own."""
    from modelfleet.operator import handlers
    from modelfleet.operator.kube import KubeCluster

    handlers.use_cluster(None)  # the operator makes its own client from $KUBECONFIG
    if request.param == "kubeconfig":
        if not REAL_KUBECONFIG:
            pytest.skip("no $KUBECONFIG: the kopf scenarios run against kmock only")
        yield from _real_cluster(KubeCluster(TEST_USER_AGENT))
        return
    with emulator() as (url, log):
        kubeconfig = {
            "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": url}}],
            "users": [{"name": "kmock", "user": {"token": "kmock"}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
        }  # fmt: skip
        (tmp_path / "kubeconfig").write_text(json.dumps(kubeconfig))
        monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))
        site = Site(KubeCluster(TEST_USER_AGENT), "ai", log, ["-A"])
        for name in ("a", "b"):
            site.api.create(node(name))
        yield site
    handlers.use_cluster(None)
    assert_allowed_by_the_charts_rbac(site.operator_requests())


def _real_cluster(api: Any) -> Iterator[Site]:
    """A fresh namespace on the real cluster, deleted afterwards (or ``$MF_TEST_NAMESPACE``, which
    must be empty and is kept); its nodes must hold two stages."""
    if len(api.list_nodes()) < 2:
        pytest.skip("the cluster of $KUBECONFIG has fewer than 2 nodes")
    given = os.environ.get("MF_TEST_NAMESPACE")
    namespace = given or f"mf-test-{uuid.uuid4().hex[:8]}"
    if not given:
        api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    try:
        yield Site(api, namespace, None, ["--namespace", namespace])
    finally:
        # the operator has stopped: drop kopf's finalizer, or the fleet (and a namespace) would stay
        fleet_ref = {"apiVersion": "modelfleet.io/v1alpha1", "kind": "ModelFleet"}
        if api.get(fleet_ref["apiVersion"], "ModelFleet", namespace, "qwen") is not None:
            api.patch({**fleet_ref, "metadata": {"name": "qwen", "namespace": namespace, "finalizers": []}})
            api.delete(fleet_ref["apiVersion"], "ModelFleet", namespace, "qwen")
        api.delete("v1", "ConfigMap", namespace, "qwen-model-summary")
        if not given:
            api.delete("v1", "Namespace", "", namespace)


@kopf.on.login(id="login_for_tests")
def login_for_tests(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """kopf's default login reads $KUBECONFIG as it was when ``kubernetes`` was imported; for the
    emulator this reads it now, for a real cluster it is kopf's own login through the client."""
    config = yaml.safe_load(Path(os.environ["KUBECONFIG"]).read_text())
    if config.get("current-context") != "kmock":
        return kopf.login_via_client(**kwargs)
    return kopf.ConnectionInfo(server=config["clusters"][0]["cluster"]["server"], token="kmock")


def wait_for(check: Callable[[], Any], timeout: float = 20.0) -> Any:
    """Poll the API until ``check`` gives a truthy value (the emulator offers no event to wait on)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.1)
    raise AssertionError(f"not reached within {timeout} s")


@contextlib.contextmanager
def operator(site: Site, create_fleet: bool = True) -> Iterator[Any]:
    """kopf running, with a model summary and a two-stage fleet created once it runs."""
    import modelfleet.operator.handlers  # noqa: F401  (registers the handlers)

    ns = site.namespace
    if create_fleet:
        site.api.create(summary_config_map("qwen", ns, summary(8)))
    body = fleet(namespace=ns, parallelism={"pipeline": 2})
    del body["metadata"]["uid"], body["metadata"]["generation"]  # the API server sets them
    settings = kopf.OperatorSettings()
    settings.posting.enabled = False
    settings.scanning.disabled = site.log is None  # one namespace, given: nothing to scan for
    with KopfRunner(["run", "--standalone", *site.kopf_args], settings=settings) as runner:
        if create_fleet:
            site.api.create(body)
        yield runner
    assert runner.exception is None, runner.output


def stage_pods(site: Site) -> dict[str, dict[str, Any]]:
    pods = site.api.list_pods(site.namespace, {"modelfleet.io/fleet": "qwen", "modelfleet.io/component": "stage"})
    return {p["metadata"]["name"]: p for p in pods if not p["metadata"].get("deletionTimestamp")}


def planned(site: Site) -> dict[str, Any] | None:
    fleet_now = site.api.get("modelfleet.io/v1alpha1", "ModelFleet", site.namespace, "qwen") or {}
    status = fleet_now.get("status") or {}
    is_planned = any(c["type"] == "Planned" and c["status"] == "True" for c in status.get("conditions") or [])
    return status if is_planned and status.get("members") else None


def test_the_operator_turns_a_model_fleet_into_a_plan_pods_services_and_status(site):
    ns = site.namespace
    with operator(site):
        status = wait_for(lambda: planned(site))
        pods = stage_pods(site)

    rev = status["revision"]
    assert sorted(pods) == [f"qwen-{rev}-g0-s0", f"qwen-{rev}-g0-s1"]
    assert all(p["metadata"]["labels"]["modelfleet.io/revision"] == rev for p in pods.values())
    plan_map = site.api.get("v1", "ConfigMap", ns, "qwen-plan")
    assert status["planHash"] == plan_map["metadata"]["annotations"]["modelfleet.io/plan-hash"]
    assert site.api.get("v1", "Service", ns, "qwen-stages")["spec"]["publishNotReadyAddresses"] is True
    assert site.api.get("v1", "Service", ns, "qwen-gateway") is not None
    assert site.api.get("apps/v1", "Deployment", ns, "qwen-gateway") is not None
    owner = next(iter(pods.values()))["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"]) == ("ModelFleet", "qwen")
    assert [(m["layerStart"], m["layerEnd"]) for m in status["members"]] == [(0, 4), (4, 8)]
    if site.log is not None:
        assert [m["node"] for m in status["members"]] == ["a", "b"]
    assert status["observedGeneration"] == 1 and status["phase"] in ("Loading", "Ready")


def test_a_failed_stage_pod_wakes_the_operator_which_replaces_it_alone(site):
    site.needs_emulator("a pod's status is the kubelet's to write")
    ns = site.namespace
    with operator(site):
        rev = wait_for(lambda: planned(site))["revision"]
        healthy, failing = f"qwen-{rev}-g0-s0", f"qwen-{rev}-g0-s1"
        healthy_uid = site.api.get("v1", "Pod", ns, healthy)["metadata"]["uid"]
        failing_uid = site.api.get("v1", "Pod", ns, failing)["metadata"]["uid"]
        failed = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": failing, "namespace": ns}}
        site.api.patch({**failed, "status": {"phase": "Failed"}})
        status = wait_for(lambda: (planned(site) or {}).get("stageRestarts"))  # well before the timer's first tick
        replaced = wait_for(lambda: site.api.get("v1", "Pod", ns, failing))

    assert status == {failing: 1}
    assert replaced["metadata"]["uid"] != failing_uid and (replaced.get("status") or {}).get("phase") != "Failed"
    assert site.api.get("v1", "Pod", ns, healthy)["metadata"]["uid"] == healthy_uid


FLEET_REF = {"apiVersion": "modelfleet.io/v1alpha1", "kind": "ModelFleet"}


def gateway_revision(site: Site) -> str:
    """The revision whose plan the gateway's pods read."""
    gateway = site.api.get("apps/v1", "Deployment", site.namespace, "qwen-gateway")
    (volume,) = [v for v in gateway["spec"]["template"]["spec"]["volumes"] if v["name"] == "plan"]
    return str(volume["configMap"]["name"]).removeprefix("qwen-plan-")


def kubelet_reports_ready(site: Site, pod: str) -> None:
    ready = [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}]
    site.api.patch({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod, "namespace": site.namespace},
                    "status": {"phase": "Running", "conditions": ready}})  # fmt: skip


def controller_rolls_out_the_gateway(site: Site) -> None:
    """What the Deployment controller reports once every gateway pod runs the current template."""
    gateway = site.api.get("apps/v1", "Deployment", site.namespace, "qwen-gateway")
    n = gateway["spec"]["replicas"]
    status = {"observedGeneration": gateway["metadata"]["generation"], "replicas": n, "updatedReplicas": n,
              "readyReplicas": n, "availableReplicas": n}  # fmt: skip
    site.api.patch({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": gateway["metadata"], "status": status})


def test_a_spec_change_rolls_out_a_new_revision_beside_the_old_one_which_goes_once_the_new_one_serves(site):
    site.needs_emulator("pod readiness and the gateway's rollout are the kubelet's and the controller's to report")
    ns = site.namespace
    with operator(site):
        old = wait_for(lambda: planned(site))["revision"]
        site.api.patch(
            {**FLEET_REF, "metadata": {"name": "qwen", "namespace": ns}, "spec": {"serving": {"maxStreams": 8}}}
        )
        new = wait_for(lambda: (planned(site) or {}).get("updateRevision"))
        both = wait_for(lambda: (p := stage_pods(site)) and len(p) == 4 and p)
        assert gateway_revision(site) == old  # the old revision serves while the new one loads
        rolling = next(c for c in planned(site)["conditions"] if c["type"] == "Progressing")
        assert rolling["reason"] == "RollingOut" and f"revision {new}" in rolling["message"]
        assert f"revision {old}, which serves" in rolling["message"]
        for name in both:
            if name.startswith(f"qwen-{new}-"):
                kubelet_reports_ready(site, name)
        wait_for(lambda: gateway_revision(site) == new)
        assert sorted(stage_pods(site)) == sorted(both)  # the old chain stays while the gateway rolls
        controller_rolls_out_the_gateway(site)
        pods = wait_for(lambda: (p := stage_pods(site)) and len(p) == 2 and p)
        status = wait_for(
            lambda: (s := planned(site)) and s["revision"] == new and s.get("updateRevision") is None and s
        )

    assert old != new and sorted(both) == sorted([f"qwen-{r}-g0-s{k}" for r in (old, new) for k in (0, 1)])
    assert sorted(pods) == [f"qwen-{new}-g0-s0", f"qwen-{new}-g0-s1"]
    assert {p["metadata"]["labels"]["modelfleet.io/revision"] for p in pods.values()} == {new}
    env = {e["name"]: e.get("value") for e in pods[f"qwen-{new}-g0-s1"]["spec"]["containers"][0]["env"]}
    assert env["MF_REVISION"] == new
    assert site.api.get("v1", "ConfigMap", ns, f"qwen-plan-{old}") is None
    plan = json.loads(site.api.get("v1", "ConfigMap", ns, f"qwen-plan-{new}")["data"]["plan.json"])
    assert plan["serving"]["max_streams"] == 8
    assert all(f"qwen-{new}-g0-s" in stage["address"] for stage in plan["groups"][0]["stages"])  # only each other
    assert status["observedGeneration"] == 2 and [m["pod"] for m in status["members"]] == sorted(pods)
    progressing = next(c for c in status["conditions"] if c["type"] == "Progressing")
    assert progressing["reason"] in ("RollingOut", "RolloutComplete")  # complete once the fleet is Ready


def test_a_new_revision_not_ready_by_its_progress_deadline_is_abandoned_and_the_old_one_keeps_serving(site):
    site.needs_emulator("the emulator's pods never become ready, so the new revision runs out of time")
    ns = site.namespace
    with operator(site):
        old = wait_for(lambda: planned(site))["revision"]
        spec = {"serving": {"maxStreams": 8}, "rollout": {"progressDeadlineSeconds": 1}}
        site.api.patch({**FLEET_REF, "metadata": {"name": "qwen", "namespace": ns}, "spec": spec})
        new = wait_for(lambda: (planned(site) or {}).get("updateRevision"))
        started = planned(site)["rolloutStartedAt"]

        def abandoned() -> dict[str, Any] | None:
            status = planned(site) or {}
            found = [c for c in status.get("conditions") or [] if c["type"] == "Progressing"]
            return found[0] if found and found[0]["reason"] == "ProgressDeadlineExceeded" else None

        progressing = wait_for(abandoned)  # the next pass, ROLLOUT_POLL_SECONDS after the first
        pods = wait_for(lambda: (p := stage_pods(site)) and all(n.startswith(f"qwen-{old}-") for n in p) and p)

    assert progressing["status"] == "False" and gateway_revision(site) == old
    assert sorted(pods) == [f"qwen-{old}-g0-s0", f"qwen-{old}-g0-s1"]
    message = progressing["message"]
    assert f"revision {new} was not ready" in message and f"its rollout began at {started}" in message
    assert f"qwen-{new}-g0-s0 (Pending)" in message and f"revision {old} keeps serving" in message


def test_a_serving_pod_deleted_during_a_rollout_comes_back_as_it_was_not_with_the_new_image(site):
    site.needs_emulator("the new revision must stay unready so that the rollout lasts")
    ns = site.namespace
    with operator(site):
        old = wait_for(lambda: planned(site))["revision"]
        gone = f"qwen-{old}-g0-s0"
        before = site.api.get("v1", "Pod", ns, gone)["spec"]["containers"][0]
        spec = {"serving": {"maxStreams": 8}, "images": {"agent": "registry.example/agent:2"}}
        site.api.patch({**FLEET_REF, "metadata": {"name": "qwen", "namespace": ns}, "spec": spec})
        new = wait_for(lambda: (planned(site) or {}).get("updateRevision"))
        wait_for(lambda: len(stage_pods(site)) == 4)
        uid = site.api.get("v1", "Pod", ns, gone)["metadata"]["uid"]
        site.api.delete("v1", "Pod", ns, gone)
        again = wait_for(lambda: (p := site.api.get("v1", "Pod", ns, gone)) and p["metadata"]["uid"] != uid and p)
        fresh = site.api.get("v1", "Pod", ns, f"qwen-{new}-g0-s0")

    assert before["image"] != "registry.example/agent:2"
    assert again["spec"]["containers"][0]["image"] == before["image"]
    assert fresh["spec"]["containers"][0]["image"] == "registry.example/agent:2"


def test_deleting_a_fleet_deletes_every_object_it_owns(site):
    ns = site.namespace
    with operator(site):
        wait_for(lambda: planned(site))
        uid = site.api.get("modelfleet.io/v1alpha1", "ModelFleet", ns, "qwen")["metadata"]["uid"]
        owned = children(site)
        assert len(owned) == 11  # 2 plans, 2 pods, 2 services, 2 policies, budget, gateway, keys; summary is the test's
        for obj in owned:
            assert [(r["uid"], r.get("controller")) for r in obj["metadata"]["ownerReferences"]] == [(uid, True)]
        site.api.delete("modelfleet.io/v1alpha1", "ModelFleet", ns, "qwen")
        wait_for(lambda: site.api.get("modelfleet.io/v1alpha1", "ModelFleet", ns, "qwen") is None)
        wait_for(lambda: not children(site), timeout=60 if site.log is None else 10)

    assert site.api.get("v1", "ConfigMap", ns, "qwen-model-summary") is not None  # not the fleet's: kept


def children(site: Site) -> list[dict[str, Any]]:
    """The fleet's objects that exist now (pods by label, the rest by name)."""
    ns, found = site.namespace, list(stage_pods(site).values())
    revisions = {p["metadata"]["labels"]["modelfleet.io/revision"] for p in found}
    for api_version, kind, name in [
        ("v1", "ConfigMap", "qwen-plan"), *(("v1", "ConfigMap", f"qwen-plan-{r}") for r in revisions), ("v1", "Service", "qwen-stages"), ("v1", "Service", "qwen-gateway"),
        ("v1", "Secret", "qwen-transport"), ("apps/v1", "Deployment", "qwen-gateway"),
        ("networking.k8s.io/v1", "NetworkPolicy", "qwen-stages"), ("networking.k8s.io/v1", "NetworkPolicy", "qwen-gateway"),
        ("policy/v1", "PodDisruptionBudget", "qwen-stages"),
    ]:  # fmt: skip
        if (obj := site.api.get(api_version, kind, ns, name)) is not None:
            found.append(obj)
    return found


def test_a_restarted_operator_creates_nothing_that_exists(site):
    site.needs_emulator("it counts the operator's requests")
    with operator(site):
        wait_for(lambda: planned(site))
    pods = {name: p["metadata"]["uid"] for name, p in stage_pods(site).items()}
    restart = len(site.log)
    with operator(site, create_fleet=False):  # resumes the fleet
        wait_for(lambda: any(r.resource == "modelfleets/status" and r.verb == "patch" for r in site.log[restart:]))
    after = Site(site.api, site.namespace, site.log[restart:]).operator_requests()
    assert [r for r in after if r.verb in ("create", "delete")] == []
    assert any(r.verb == "get" and r.resource == "pods" for r in after)  # it did look
    assert {name: p["metadata"]["uid"] for name, p in stage_pods(site).items()} == pods


# ---- RBAC -------------------------------------------------------------------------------------

CLUSTER_SCOPED_RESOURCES = {"nodes", "namespaces", "customresourcedefinitions"}
HELM = os.environ.get("MF_HELM") or str(ROOT / "tools" / "helm" / "bin" / "helm")


def chart_rules() -> dict[str, list[dict[str, Any]]]:
    """The chart's rules by role: 'all' (the ClusterRole watching all namespaces, the default),
    'cluster' and 'namespace' (the ClusterRole and a Role when it watches listed namespaces).
    Rendered by helm when there is one, else read from the template's definitions."""
    if Path(HELM).is_file() and os.access(HELM, os.X_OK):
        return {
            "all": _rendered_rules([])["ClusterRole"],
            **dict(zip(("cluster", "namespace"), _namespaced_roles(), strict=True)),
        }
    template = (ROOT / "charts" / "modelfleet" / "templates" / "rbac.yaml").read_text()
    defined = dict(re.findall(r'{{- define "modelfleet\.(\w+)" -}}\n(.*?){{- end -}}', template, re.S))
    namespaced, cluster = yaml.safe_load(defined["namespacedRules"]), yaml.safe_load(defined["clusterRules"])
    return {"all": cluster + namespaced, "cluster": cluster, "namespace": namespaced}


def _namespaced_roles() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rendered = _rendered_rules(
        ["--set", "operator.watch.allNamespaces=false", "--set", "operator.watch.namespaces={ai}"]
    )
    return rendered["ClusterRole"], rendered["Role"]


def _rendered_rules(values: list[str]) -> dict[str, list[dict[str, Any]]]:
    command = [HELM, "template", "mf", str(ROOT / "charts" / "modelfleet"), "-n", "modelfleet-system", *values]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    return {d["kind"]: d["rules"] for d in docs if d["kind"] in ("ClusterRole", "Role")}


def allows(rules: list[dict[str, Any]], request: Request) -> bool:
    return any(
        request.group in rule["apiGroups"] and request.resource in rule["resources"] and request.verb in rule["verbs"]
        for rule in rules
    )


def rbac_denials(requests: list[Request], rules: dict[str, list[dict[str, Any]]]) -> list[str]:
    """What the chart would forbid: every request under the all-namespaces ClusterRole; with listed
    namespaces, namespaced requests under the Role and cluster-scoped ones under the ClusterRole
    (cluster-wide requests for namespaced kinds are kopf's -A mode, which only the former serves)."""
    denied = set()
    for r in set(requests):
        what = f"{r.verb} {r.group or 'core'}/{r.resource} in {r.namespace or 'the cluster'}"
        if not allows(rules["all"], r):
            denied.add(f"{what} (ClusterRole, all namespaces)")
        if r.namespace is not None and not allows(rules["namespace"], r):
            denied.add(f"{what} (Role, listed namespaces)")
        if r.namespace is None and r.resource in CLUSTER_SCOPED_RESOURCES and not allows(rules["cluster"], r):
            denied.add(f"{what} (ClusterRole, listed namespaces)")
    return sorted(denied)


_RULES: dict[str, list[dict[str, Any]]] = {}


def assert_allowed_by_the_charts_rbac(requests: list[Request]) -> None:
    if not _RULES:
        _RULES.update(chart_rules())
    assert requests, "the operator made no requests"
    denied = rbac_denials(requests, _RULES)
    assert not denied, "the chart's RBAC forbids what the operator did: " + "; ".join(denied)


def test_the_rbac_check_names_a_request_the_chart_does_not_allow():
    rules = chart_rules()
    allowed = Request("kopf/1", "patch", "modelfleet.io", "modelfleets/status", "ai")
    forbidden = Request("modelfleet-operator/1", "delete", "", "secrets", "ai")
    assert rbac_denials([allowed], rules) == []
    assert rbac_denials([forbidden], rules) == [
        "delete core/secrets in ai (ClusterRole, all namespaces)",
        "delete core/secrets in ai (Role, listed namespaces)",
    ]
