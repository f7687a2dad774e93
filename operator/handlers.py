"""kopf handlers for ModelFleet: thin shells over :func:`modelfleet.operator.reconcile.reconcile`.

Create, update and resume run one reconcile pass; a timer runs it again every
``RESYNC_SECONDS`` to follow pods (members' phases, failed stages replaced alone and counted).
A stage pod that fails wakes its fleet at once: an annotation on the fleet is an update.
An invalid spec ends in ``kopf.PermanentError``; "not yet" (no model summary, no capacity) in
``kopf.TemporaryError`` with a delay. Status is written through kopf's ``patch``, which kopf
applies whether the handler succeeds or raises.
"""

from __future__ import annotations

from typing import Any

import kopf

from . import metrics, names
from .reconcile import Cluster, reconcile, wake_up
from .spec import GROUP, PLURAL, VERSION

RESYNC_SECONDS = 15.0
_cluster: Cluster | None = None


def cluster() -> Cluster:
    """The API client, made once per process (tests replace it with ``use_cluster``)."""
    global _cluster
    if _cluster is None:
        from .kube import KubeCluster

        _cluster = KubeCluster()
    return _cluster


def use_cluster(replacement: Cluster | None) -> None:
    global _cluster
    _cluster = replacement


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.timer(GROUP, VERSION, PLURAL, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS)
def reconcile_fleet(body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger, **_: Any) -> None:
    outcome = reconcile(body, cluster())
    metrics.record(body["metadata"].get("namespace", ""), body["metadata"]["name"], outcome)
    patch.status.update(outcome.status)
    for line in outcome.applied:
        logger.debug(line)
    for pod in outcome.replaced:
        logger.info(f"replaced the failed stage pod {pod}")
    if outcome.permanent_error:
        raise kopf.PermanentError(outcome.permanent_error)
    if outcome.retry_after_seconds is not None:
        raise kopf.TemporaryError(outcome.message, delay=outcome.retry_after_seconds)


def _failed(status: kopf.Status, **_: Any) -> bool:
    return status.get("phase") == "Failed"


@kopf.on.event("", "v1", "pods", labels={names.LABEL_COMPONENT: "stage", names.LABEL_FLEET: kopf.PRESENT}, when=_failed)
def wake_fleet_of_failed_stage(meta: kopf.Meta, **_: Any) -> None:
    cluster().patch(wake_up(meta))
