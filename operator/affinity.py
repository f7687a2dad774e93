"""Affinity, evaluated as the scheduler evaluates it. Pure: Nodes, label sets and an affinity in.

Required node affinity
(``nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms``): the terms are
ORed; within a term, every ``matchExpressions`` requirement (on node labels) and every
``matchFields`` requirement (on ``metadata.name``, the one field Kubernetes supports) is ANDed. A
term with no requirements matches no node, and so does an empty list of terms. Operators: ``In``,
``NotIn`` (also true when the label is absent), ``Exists``, ``DoesNotExist``, ``Gt`` and ``Lt`` (the
label's value and the one listed value as integers; false when the label is absent or not an
integer).

Preferred node affinity (``preferredDuringSchedulingIgnoredDuringExecution``): a node scores the
sum of the weights of the preferences it matches (:func:`preference_score`); the planner takes the
highest-scoring nodes first. Every stage pod is bound to its node by name, so the scheduler's own
weighing has nothing left to choose.

Required pod affinity and anti-affinity with ``topologyKey: kubernetes.io/hostname`` are evaluated
among the fleet's own stage members (:func:`pod_terms`, :func:`selects` on :func:`member_labels`):
members that an anti-affinity term selects share a node with no other member, and an affinity term
whose selector stays within the fleet needs every member on one node. The rest (other topology
keys, pods outside the fleet, preferred pod terms) stays in the pods for the scheduler and is named
in a note the operator adds to the ``Planned`` condition.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from . import names

Requirement = Mapping[str, Any]
OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt")
HOSTNAME = "kubernetes.io/hostname"
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"


def affinity_rejection(node: Mapping[str, Any], affinity: Mapping[str, Any] | None) -> str | None:
    """Why the required node affinity excludes ``node``, or None when it admits it (or is absent)."""
    required = ((affinity or {}).get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    if required is None:
        return None
    terms = required.get("nodeSelectorTerms") or []
    labels, fields = _labels_and_fields(node)
    failures = []
    for k, term in enumerate(terms):
        why = _term_failure(term, labels, fields)
        if why is None:
            return None
        failures.append(f"term {k}: {why}")
    if not failures:
        return "placement.affinity: nodeSelectorTerms is empty and matches no node"
    return "placement.affinity: no required nodeSelectorTerm matches (" + "; ".join(failures) + ")"


def preference_score(node: Mapping[str, Any], affinity: Mapping[str, Any] | None) -> int:
    """The sum of the weights of the preferred node-affinity terms ``node`` matches (an empty
    preference matches nothing, as the scheduler's weight-0 no-op)."""
    preferred = ((affinity or {}).get("nodeAffinity") or {}).get(PREFERRED) or []
    labels, fields = _labels_and_fields(node)
    matched = (p for p in preferred if _term_failure(p.get("preference") or {}, labels, fields) is None)
    return sum(int(p.get("weight", 0)) for p in matched)


def _labels_and_fields(node: Mapping[str, Any]) -> tuple[Mapping[str, str], Mapping[str, str]]:
    metadata = node.get("metadata") or {}
    return metadata.get("labels") or {}, {"metadata.name": metadata.get("name", "")}


def _term_failure(term: Mapping[str, Any], labels: Mapping[str, str], fields: Mapping[str, str]) -> str | None:
    expressions: Sequence[Requirement] = term.get("matchExpressions") or []
    field_requirements: Sequence[Requirement] = term.get("matchFields") or []
    if not expressions and not field_requirements:
        return "empty term matches no node"
    for kind, values, requirements in (("label", labels, expressions), ("field", fields, field_requirements)):
        for requirement in requirements:
            if requirement.get("operator") not in OPERATORS:
                return f"{kind} {_describe(requirement)}: unknown operator"
            if not requirement_holds(requirement, values):
                return f"{kind} {_describe(requirement)} not met"
    return None


def requirement_holds(requirement: Requirement, values: Mapping[str, str]) -> bool:
    """One NodeSelectorRequirement (key, operator, values) against a node's labels or fields."""
    key, operator = requirement.get("key", ""), requirement.get("operator")
    wanted = [str(v) for v in requirement.get("values") or []]
    present, value = key in values, values.get(key)
    if operator == "In":
        return present and value in wanted
    if operator == "NotIn":
        return not present or value not in wanted
    if operator == "Exists":
        return present
    if operator == "DoesNotExist":
        return not present
    if operator in ("Gt", "Lt"):
        have, limit = _integer(value), _integer(wanted[0] if len(wanted) == 1 else None)
        if have is None or limit is None:
            return False
        return have > limit if operator == "Gt" else have < limit
    return False  # an unknown operator admits no node


def _integer(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _describe(requirement: Requirement) -> str:
    values = requirement.get("values")
    listed = f" {list(values)}" if values else ""
    return f"{requirement.get('key', '')} {requirement.get('operator')}{listed}"


# ---- pod affinity among the fleet's members -----------------------------------------------------


def member_labels(fleet: str, group: int, stage: int, tp_rank: int) -> dict[str, str]:
    """A stage pod's labels as pod (anti-)affinity selectors see them (objects.stage_pod's, less
    the revision, which is made from the plan and so not known while planning)."""
    return {
        names.LABEL_FLEET: fleet, names.LABEL_COMPONENT: "stage", names.LABEL_GROUP: str(group),
        names.LABEL_STAGE_INDEX: str(stage), names.LABEL_TP_RANK: str(tp_rank),
    }  # fmt: skip


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A LabelSelector (``matchLabels`` and ``matchExpressions``, ANDed) against a pod's labels;
    an empty selector selects every pod."""
    if any(labels.get(key) != value for key, value in (selector.get("matchLabels") or {}).items()):
        return False
    return all(requirement_holds(r, labels) for r in selector.get("matchExpressions") or [])


def pod_terms(
    affinity: Mapping[str, Any] | None, fleet: str, namespace: str
) -> tuple[list[tuple[str, int, Mapping[str, Any]]], list[str]]:
    """The required pod terms the planner evaluates among the fleet's members, as (``podAffinity``
    or ``podAntiAffinity``, index, labelSelector), and a note for each part left to the scheduler."""
    evaluated, notes = [], []
    for kind in ("podAffinity", "podAntiAffinity"):
        section = (affinity or {}).get(kind) or {}
        for k, term in enumerate(section.get(REQUIRED) or []):
            where = f"placement.affinity.{kind} required term {k}"
            within = _within_fleet(term, fleet, namespace)
            if term.get("topologyKey") != HOSTNAME:
                notes.append(
                    f"{where} (topologyKey {term.get('topologyKey')}) is left to the scheduler: the planner evaluates {HOSTNAME} only"
                )
            elif term.get("labelSelector") is None:
                continue  # a null selector selects no pod
            elif kind == "podAffinity" and not within:
                notes.append(
                    f"{where} selects pods outside fleet {fleet}: the scheduler checks it on each planned node"
                )
            else:
                evaluated.append((kind, k, term["labelSelector"]))
                if not within:
                    notes.append(
                        f"{where} is evaluated among fleet {fleet}'s members; the scheduler checks the other pods it selects"
                    )
        if section.get(PREFERRED):
            notes.append(
                f"placement.affinity.{kind} preferred terms are left to the scheduler (each stage pod is bound to its planned node)"
            )
    return evaluated, notes


def _within_fleet(term: Mapping[str, Any], fleet: str, namespace: str) -> bool:
    """Whether a pod term can select only this fleet's pods: its selector pins the fleet label and
    it looks in the fleet's namespace alone."""
    if term.get("namespaceSelector") is not None or set(term.get("namespaces") or []) - {namespace}:
        return False
    selector = term.get("labelSelector") or {}
    if (selector.get("matchLabels") or {}).get(names.LABEL_FLEET) == fleet:
        return True
    return any(
        r.get("key") == names.LABEL_FLEET and r.get("operator") == "In" and list(r.get("values") or []) == [fleet]
        for r in selector.get("matchExpressions") or []
    )
