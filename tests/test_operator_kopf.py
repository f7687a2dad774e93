"""End to end: the kopf operator reconciles a ModelFleet against kmock's Kubernetes emulator.

kmock 0.8 lacks parts of the API (see shared FACTS); ``Emulator`` is the thin test-only layer
that adds them: uid, resourceVersion, generation and creationTimestamp on writes, the namespace
from the URL, ``kind`` on lists, and label selectors on lists. It uses kmock's private hooks, so
kmock is pinned to 0.8. The emulator serves from its own thread and event loop, kopf (through
KopfRunner) from another, and the test drives both through the real ``kubernetes`` client.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import itertools
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kmock
import kopf
import pytest
from fleet_fixtures import fleet, node, summary, summary_config_map
from kmock._internal import enums
from kopf.testing import KopfRunner

KINDS = {
    "v1/nodes": "Node", "v1/namespaces": "Namespace", "v1/pods": "Pod", "v1/services": "Service",
    "v1/configmaps": "ConfigMap", "v1/secrets": "Secret", "v1/events": "Event", "batch/v1/jobs": "Job", "apps/v1/deployments": "Deployment",
    "networking.k8s.io/v1/networkpolicies": "NetworkPolicy", "policy/v1/poddisruptionbudgets": "PodDisruptionBudget",
}  # fmt: skip
CLUSTER_SCOPED = {"v1/nodes", "v1/namespaces"}
VERBS = {"get", "list", "watch", "create", "patch", "delete"}


class Emulator(kmock.KubernetesEmulator):
    _versions = itertools.count(1)

    async def _handle(self, request: Any) -> Any:
        writes = (enums.action.CREATE, enums.action.UPDATE)
        if request.resource is not None and request.action in writes and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            if request.action == enums.action.CREATE:
                if request.namespace:
                    meta["namespace"] = request.namespace
                created = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                meta.update(uid=str(uuid.uuid4()), generation=1, creationTimestamp=created)
            meta["resourceVersion"] = str(next(self._versions))
        return await super()._handle(request)

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


@pytest.fixture
def api_url() -> Iterator[str]:
    """The emulator's URL while it serves from a thread of its own."""
    started, stop, found = threading.Event(), threading.Event(), {}

    async def serve() -> None:
        async with Emulator() as emulator, kmock.Server(emulator) as server:
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
    yield found["url"]
    stop.set()
    thread.join(10)


@pytest.fixture
def cluster(api_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    from modelfleet.operator import handlers
    from modelfleet.operator.kube import KubeCluster

    kubeconfig = {
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": api_url}}],
        "users": [{"name": "test", "user": {"token": "test"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "test"}}],
    }  # fmt: skip
    (tmp_path / "kubeconfig").write_text(json.dumps(kubeconfig))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))
    handlers.use_cluster(None)  # the operator makes its own client from $KUBECONFIG
    yield KubeCluster()
    handlers.use_cluster(None)


@kopf.on.login(id="kmock_login")
def kmock_login(**_: Any) -> kopf.ConnectionInfo:
    """kopf's default login reads $KUBECONFIG as it was when ``kubernetes`` was imported; this reads it now."""
    config = json.loads(Path(os.environ["KUBECONFIG"]).read_text())
    return kopf.ConnectionInfo(server=config["clusters"][0]["cluster"]["server"], token="test")


def wait_for(check: Callable[[], Any], timeout: float = 20.0) -> Any:
    """Poll the API until ``check`` gives a truthy value (the emulator offers no event to wait on)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.1)
    raise AssertionError(f"not reached within {timeout} s")


@contextlib.contextmanager
def operator_with_fleet(cluster: Any) -> Iterator[Any]:
    """kopf running against the emulator, with two nodes, a model summary and a two-stage fleet."""
    import modelfleet.operator.handlers  # noqa: F401  (registers the handlers)

    for name in ("a", "b"):
        cluster.create(node(name))
    cluster.create(summary_config_map("qwen", "ai", summary(8)))
    body = fleet(parallelism={"pipeline": 2})
    del body["metadata"]["uid"], body["metadata"]["generation"]  # the API server sets them
    settings = kopf.OperatorSettings()
    settings.posting.enabled = False
    with KopfRunner(["run", "-A", "--standalone"], settings=settings) as runner:
        cluster.create(body)
        yield runner
    assert runner.exception is None, runner.output


def test_the_operator_turns_a_model_fleet_into_a_plan_pods_services_and_status(cluster):
    with operator_with_fleet(cluster):
        status = wait_for(lambda: _planned(cluster))
        pods = cluster.list_pods("ai", {"modelfleet.io/fleet": "qwen"})

    assert sorted(p["metadata"]["name"] for p in pods) == ["qwen-g0-s0", "qwen-g0-s1"]
    plan_map = cluster.get("v1", "ConfigMap", "ai", "qwen-plan")
    assert status["planHash"] == plan_map["metadata"]["annotations"]["modelfleet.io/plan-hash"]
    assert cluster.get("v1", "Service", "ai", "qwen-stages")["spec"]["publishNotReadyAddresses"] is True
    assert cluster.get("v1", "Service", "ai", "qwen-gateway") is not None
    assert cluster.get("apps/v1", "Deployment", "ai", "qwen-gateway") is not None
    owner = pods[0]["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"]) == ("ModelFleet", "qwen")
    assert [(m["node"], m["layerStart"], m["layerEnd"]) for m in status["members"]] == [("a", 0, 4), ("b", 4, 8)]
    assert status["observedGeneration"] == 1 and status["phase"] == "Loading"


def test_a_failed_stage_pod_wakes_the_operator_which_replaces_it_alone(cluster):
    with operator_with_fleet(cluster):
        wait_for(lambda: _planned(cluster))
        healthy = cluster.get("v1", "Pod", "ai", "qwen-g0-s0")["metadata"]["uid"]
        failing = cluster.get("v1", "Pod", "ai", "qwen-g0-s1")["metadata"]["uid"]
        cluster.patch(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "qwen-g0-s1", "namespace": "ai"},
                "status": {"phase": "Failed"},
            }
        )
        status = wait_for(lambda: (_planned(cluster) or {}).get("stageRestarts"))  # well before the timer's first tick
        replaced = wait_for(lambda: cluster.get("v1", "Pod", "ai", "qwen-g0-s1"))

    assert status == {"qwen-g0-s1": 1}
    assert replaced["metadata"]["uid"] != failing and (replaced.get("status") or {}).get("phase") != "Failed"
    assert cluster.get("v1", "Pod", "ai", "qwen-g0-s0")["metadata"]["uid"] == healthy


def _planned(cluster: Any) -> dict[str, Any] | None:
    fleet_now = cluster.get("modelfleet.io/v1alpha1", "ModelFleet", "ai", "qwen") or {}
    status = fleet_now.get("status") or {}
    planned = any(c["type"] == "Planned" and c["status"] == "True" for c in status.get("conditions") or [])
    return status if planned and status.get("members") else None
