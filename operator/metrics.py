"""The operator's Prometheus metrics, prefix ``modelfleet_operator_``, on a registry of its own.

Labels name the fleet as everywhere else (``namespace``, ``fleet``); ``result`` is one of
``ok``, ``retry`` (not yet: no summary, no capacity) and ``invalid`` (a permanent error).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from .reconcile import Outcome

REGISTRY = CollectorRegistry()
RECONCILES = Counter(
    "modelfleet_operator_reconciles_total",
    "Reconcile passes, by result",
    ["namespace", "fleet", "result"],
    registry=REGISTRY,
)
STAGE_REPLACEMENTS = Counter(
    "modelfleet_operator_stage_replacements_total",
    "Failed stage pods replaced",
    ["namespace", "fleet"],
    registry=REGISTRY,
)
MEMBERS = Gauge("modelfleet_operator_members", "Stage members in the plan", ["namespace", "fleet"], registry=REGISTRY)
READY_MEMBERS = Gauge(
    "modelfleet_operator_ready_members", "Stage members ready", ["namespace", "fleet"], registry=REGISTRY
)


def record(namespace: str, fleet: str, outcome: Outcome) -> None:
    result = "invalid" if outcome.permanent_error else "retry" if outcome.retry_after_seconds is not None else "ok"
    RECONCILES.labels(namespace, fleet, result).inc()
    if outcome.replaced:
        STAGE_REPLACEMENTS.labels(namespace, fleet).inc(len(outcome.replaced))
    members = outcome.status.get("members")
    if isinstance(members, list):
        MEMBERS.labels(namespace, fleet).set(len(members))
        READY_MEMBERS.labels(namespace, fleet).set(sum(m.get("phase") == "Ready" for m in members))


def serve(port: int) -> None:
    """/metrics on ``port``, from a daemon thread."""
    start_http_server(port, registry=REGISTRY)
