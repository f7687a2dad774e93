"""Required node affinity, evaluated as the scheduler evaluates it. Pure: a Node and an affinity in.

``nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms``: the terms are
ORed; within a term, every ``matchExpressions`` requirement (on node labels) and every
``matchFields`` requirement (on ``metadata.name``, the one field Kubernetes supports) is ANDed. A
term with no requirements matches no node, and so does an empty list of terms. Operators: ``In``,
``NotIn`` (also true when the label is absent), ``Exists``, ``DoesNotExist``, ``Gt`` and ``Lt`` (the
label's value and the one listed value as integers; false when the label is absent or not an
integer). Preferred terms (``preferredDuringSchedulingIgnoredDuringExecution``) are not evaluated:
the pods carry them and the scheduler weighs them among the nodes it may use, and every stage pod
is bound to one node by name anyway.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Requirement = Mapping[str, Any]
OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt")


def affinity_rejection(node: Mapping[str, Any], affinity: Mapping[str, Any] | None) -> str | None:
    """Why the required node affinity excludes ``node``, or None when it admits it (or is absent)."""
    required = ((affinity or {}).get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    if required is None:
        return None
    terms = required.get("nodeSelectorTerms") or []
    metadata = node.get("metadata") or {}
    labels, fields = metadata.get("labels") or {}, {"metadata.name": metadata.get("name", "")}
    failures = []
    for k, term in enumerate(terms):
        why = _term_failure(term, labels, fields)
        if why is None:
            return None
        failures.append(f"term {k}: {why}")
    if not failures:
        return "placement.affinity: nodeSelectorTerms is empty and matches no node"
    return "placement.affinity: no required nodeSelectorTerm matches (" + "; ".join(failures) + ")"


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
