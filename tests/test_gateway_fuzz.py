"""A property-based fuzz of the gateway from its own ``/openapi.json`` (issue 30): schemathesis
generates requests, valid and invalid, for every operation the served schema lists, against a
gateway over a live fleet of the tiny model, and fails on any 5xx or response that breaks the
schema. The number of cases is bounded (:data:`CASES` per operation, ``max_tokens`` kept small),
so it runs in CI; operations added later are fuzzed without a change here.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from test_gateway import Served, TestFleet, checkpoint, fleet, ready_gateway, reference  # noqa: F401  (module fixtures)

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402  (after the skip)
from schemathesis import checks as schemathesis_checks  # noqa: E402

# cases per operation and mode: valid requests (which generate) and invalid ones (which must get 4xx)
CASES = {"positive": 30, "negative": 20}
MAX_TOKENS_CAP = 8  # generated token budgets: enough to stream, few enough to keep each case short
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")
CHECKS = [schemathesis_checks.not_a_server_error, schemathesis_checks.response_schema_conformance]


@pytest.fixture(scope="module")
def served(fleet) -> Iterator[Served]:  # type: ignore[no-untyped-def]  # noqa: F811
    with ready_gateway(fleet.plan) as served:
        yield served


def steered(body: Any, model: str) -> Any:
    """A generated body aimed at the served model (when its ``model`` is a string: any other name
    is a 404 before anything else is read) with its token budgets (when integers) at most
    MAX_TOKENS_CAP."""
    if isinstance(body, dict):
        if isinstance(body.get("model"), str):
            body["model"] = model
        for field in TOKEN_FIELDS:
            value = body.get(field)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS_CAP:
                body[field] = 1 + value % MAX_TOKENS_CAP
    return body


def fuzz(strategy: Any, examples: int, check: Any) -> None:
    """Run ``check`` on ``examples`` cases drawn from ``strategy``, reproducibly."""

    @settings(
        max_examples=examples, deadline=None, database=None, derandomize=True,
        phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    @given(case=strategy)
    def run(case: Any) -> None:
        check(case)

    run()


@pytest.mark.slow
def test_fuzzing_every_operation_of_the_served_schema_finds_no_5xx_and_no_schema_violation(served: Served) -> None:
    schema = schemathesis.openapi.from_url(served.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {"/v1/completions", "/v1/chat/completions"} <= {op.path for op in operations}
    model = served.gateway.config.plan.model.served_name
    ran: dict[str, int] = {}
    statuses: dict[int, int] = {}
    failures: list[str] = []
    started = time.monotonic()
    with requests.Session() as session:  # schemathesis' transport; one keep-alive connection

        def check(case: Any) -> None:
            label = f"{case.operation.method.upper()} {case.operation.path}"
            case.body = steered(case.body, model)
            response = case.call(session=session, base_url=served.url, timeout=60)
            ran[label] = ran.get(label, 0) + 1
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            try:
                case.validate_response(response, checks=CHECKS)
            except AssertionError as exc:  # schemathesis' failure groups are AssertionErrors
                failures.append(f"{label}: {response.status_code} {response.text[:300]!r}: {exc}"[:1200])

        for operation in operations:
            for mode, examples in CASES.items():
                try:
                    fuzz(operation.as_strategy(GenerationMode(mode)), examples, check)
                except Unsatisfiable:  # an operation with no parameters or body has no invalid request
                    assert mode == "negative" and not operation.body and not operation.query, operation.path
    total = sum(ran.values())
    print(
        f"fuzz: {time.monotonic() - started:.1f} s, {total} cases over {len(ran)} operations {ran}; statuses {dict(sorted(statuses.items()))}"
    )
    assert not failures, "\n".join(failures[:10])
    assert total >= 100 and len(ran) == len(operations)
