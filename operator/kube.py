"""The real :class:`~modelfleet.operator.reconcile.Cluster`: the Kubernetes API through the
``kubernetes`` client's dynamic client (one code path for every kind).

The client is imported on first use: it reads ``$KUBECONFIG`` at import time, and importing it
costs a second that ``modelfleet render`` does not need.
"""

from __future__ import annotations

import contextlib
import json
import os
import urllib.request
from collections.abc import Mapping
from typing import Any

from modelfleet import __version__

from . import names

Obj = dict[str, Any]
AGENT_STATUS_TIMEOUT_SECONDS = 0.5  # per member, each pass; a loading agent answers at once


USER_AGENT = f"modelfleet-operator/{__version__}"  # names the operator's requests in audit logs


class KubeCluster:
    def __init__(self, user_agent: str = USER_AGENT) -> None:
        from kubernetes import config, dynamic
        from kubernetes.client import api_client

        try:
            config.load_incluster_config()
        except config.ConfigException:  # $KUBECONFIG as it is now, not as it was at import
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
        client = api_client.ApiClient()
        client.user_agent = user_agent
        self._client = dynamic.DynamicClient(client)

    def _resource(self, api_version: str, kind: str) -> Any:
        return self._client.resources.get(api_version=api_version, kind=kind)

    def list_nodes(self) -> list[Obj]:
        return [item.to_dict() for item in self._resource("v1", "Node").get().items]

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Obj | None:
        from kubernetes.dynamic.exceptions import NotFoundError

        try:
            return dict(self._resource(api_version, kind).get(name=name, namespace=namespace).to_dict())
        except NotFoundError:
            return None

    def create(self, obj: Obj) -> None:
        self._resource(obj["apiVersion"], obj["kind"]).create(body=obj, namespace=obj["metadata"].get("namespace"))

    def patch(self, obj: Obj) -> None:
        meta = obj["metadata"]
        resource = self._resource(obj["apiVersion"], obj["kind"])
        resource.patch(
            body=obj, name=meta["name"], namespace=meta["namespace"], content_type="application/merge-patch+json"
        )

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        from kubernetes.dynamic.exceptions import NotFoundError

        with contextlib.suppress(NotFoundError):  # already gone: what deleting asked for
            self._resource(api_version, kind).delete(name=name, namespace=namespace)

    def list_pods(self, namespace: str, labels: Mapping[str, str]) -> list[Obj]:
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        return [
            item.to_dict()
            for item in self._resource("v1", "Pod").get(namespace=namespace, label_selector=selector).items
        ]

    def agent_status(self, pod: Obj) -> Obj | None:
        return read_agent_status(pod)


def read_agent_status(pod: Obj, port: int = names.AGENT_HTTP_PORT) -> Obj | None:
    """GET the agent's /status on its pod IP; a slow or absent answer is None, not an error."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    try:
        with urllib.request.urlopen(f"http://{ip}:{port}/status", timeout=AGENT_STATUS_TIMEOUT_SECONDS) as response:
            document = json.loads(response.read())
    except (OSError, ValueError):
        return None
    return document if isinstance(document, dict) else None
