"""Plain-data builders for operator tests: Node objects, model summaries, ModelFleet objects."""

from __future__ import annotations

import re
from typing import Any

from modelfleet.operator.summary import ModelSummary

GiB = 1 << 30
REVISION_IN_NAME = re.compile(r"-[0-9a-f]{10}-g(?=[0-9])")


def unrevised(text: str) -> str:
    """``text`` with the revision left out of stage pod names: qwen-0123456789-g0-s1 -> qwen-g0-s1."""
    return REVISION_IN_NAME.sub("-g", text)


def node(name: str, memory: str = "18Gi", labels: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    """A Ready Node; ``extra`` may hold allocatable resources (gpus=...), taints=, unschedulable=, ready=."""
    allocatable = {"cpu": "8", "memory": memory, **extra.get("allocatable", {})}
    ready = "True" if extra.get("ready", True) else "False"
    return {
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels or {}},
        "spec": {"taints": extra.get("taints", []), "unschedulable": extra.get("unschedulable", False)},
        "status": {"allocatable": allocatable, "conditions": [{"type": "Ready", "status": ready}]},
    }  # fmt: skip


def summary(layers: int = 8, layer_gib: float = 1.0, kv_per_position: int = 0, **fields: Any) -> ModelSummary:
    """A model of ``layers`` equal layers; embedding and head are 0 bytes unless given."""
    values: dict[str, Any] = {
        "family": "qwen3_moe", "num_layers": layers, "layer_bytes": [int(layer_gib * GiB)] * layers,
        "embed_bytes": 0, "norm_bytes": 0, "head_matrix_bytes": 0, "kv_entries": [[{"bytes_per_row": kv_per_position}]] * layers,
    }  # fmt: skip
    return ModelSummary.model_validate({**values, **fields})


def fleet(name: str = "qwen", namespace: str = "ai", generation: int = 1, **spec: Any) -> dict[str, Any]:
    body = {"model": {"uri": "pvc://models/qwen3", "servedName": "qwen3"}, **spec}
    return {
        "apiVersion": "modelfleet.io/v1alpha1", "kind": "ModelFleet",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}", "generation": generation},
        "spec": body,
    }  # fmt: skip


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


class FakeCluster:
    """An in-memory API for reconcile tests: objects by (kind, namespace, name), and a call log."""

    def __init__(self, nodes: list[dict[str, Any]], objects: list[dict[str, Any]] = ()):  # type: ignore[assignment]
        self.nodes = nodes
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.log: list[str] = []
        self.agents: dict[str, dict[str, Any]] = {}  # /status documents by pod name
        for obj in objects:
            self.objects[self._key(obj)] = obj

    @staticmethod
    def _key(obj: dict[str, Any]) -> tuple[str, str, str]:
        return obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"]

    def list_nodes(self) -> list[dict[str, Any]]:
        return list(self.nodes)

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((kind, namespace, name))

    def create(self, obj: dict[str, Any]) -> None:
        assert self._key(obj) not in self.objects, f"{self._key(obj)} exists"
        self.objects[self._key(obj)] = obj
        self.log.append(f"create {obj['kind']}/{obj['metadata']['name']}")

    def patch(self, obj: dict[str, Any]) -> None:
        live = self.objects[self._key(obj)]
        patched = merge_patch(live, obj)
        if patched.get("spec") != live.get("spec"):  # as the API server does: a new spec, a new generation
            patched["metadata"]["generation"] = int(live["metadata"].get("generation") or 1) + 1
        self.objects[self._key(obj)] = patched
        self.log.append(f"patch {obj['kind']}/{obj['metadata']['name']}")

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        self.objects.pop((kind, namespace, name), None)
        self.log.append(f"delete {kind}/{name}")

    def list_pods(self, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        return [
            o for (kind, ns, _), o in self.objects.items()
            if kind == "Pod" and ns == namespace and labels.items() <= (o["metadata"].get("labels") or {}).items()
        ]  # fmt: skip

    def agent_status(self, pod: dict[str, Any]) -> dict[str, Any] | None:
        return self.agents.get(pod["metadata"]["name"])

    def of_kind(self, kind: str) -> dict[str, dict[str, Any]]:
        return {name: o for (k, _, name), o in self.objects.items() if k == kind}

    def pods(self) -> list[str]:
        """Stage and inspection pod names, sorted, without their revision."""
        return sorted(unrevised(name) for name in self.of_kind("Pod"))

    def pod_name(self, short: str, revision: str = "") -> str:
        """The full name of the one pod (of ``revision``, when given) whose name without its revision is ``short``."""
        (name,) = [
            name
            for name in self.of_kind("Pod")
            if unrevised(name) == short and (not revision or f"-{revision}-g" in name)
        ]
        return name

    def revisions(self) -> set[str]:
        """The revisions that have stage pods."""
        return {p["metadata"]["labels"].get("modelfleet.io/revision", "") for p in self.of_kind("Pod").values()}

    def settle_gateway(self) -> None:
        """What the Deployment controller reports once every gateway pod runs the current template."""
        gateway = next(iter(self.of_kind("Deployment").values()))
        n = gateway["spec"]["replicas"]
        gateway["status"] = {
            "observedGeneration": gateway["metadata"].get("generation", 1), "replicas": n, "updatedReplicas": n,
            "readyReplicas": n, "availableReplicas": n,
        }  # fmt: skip

    def unrevised_log(self) -> list[str]:
        return [unrevised(line) for line in self.log]

    def set_pod(self, name: str, phase: str, ready: bool = False, revision: str = "") -> None:
        """Set a pod's phase; ``name`` without the revision."""
        pod = self.of_kind("Pod")[self.pod_name(name, revision)]
        conditions = [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": str(ready)}]
        pod["status"] = {"phase": phase, "conditions": conditions}


def summary_config_map(fleet_name: str, namespace: str, model: ModelSummary) -> dict[str, Any]:
    from modelfleet.operator.summary import SUMMARY_KEY, summary_config_map_name

    meta = {"name": summary_config_map_name(fleet_name), "namespace": namespace}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {SUMMARY_KEY: model.model_dump_json()}}
