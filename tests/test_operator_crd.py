"""The ModelFleet CRD and ModelFleetSpec accept and reject the same specs, with the same defaults.

The CRD is checked offline as the API server would: structural defaults applied first, then the
OpenAPI schema (openapi-schema-validator, unknown fields rejected as ``kubectl apply`` does), then
every ``x-kubernetes-validations`` CEL rule (cel-python, with Kubernetes' ``quantity()``).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from celpy import celtypes
from openapi_schema_validator import OAS30Validator

from modelfleet.operator.spec import ModelFleetSpec, SpecError, parse_spec
from modelfleet.planner import quantity_value

CRD_PATH = Path(__file__).parents[1] / "crds" / "modelfleets.modelfleet.io.yaml"
CRD = yaml.safe_load(CRD_PATH.read_text())
VERSION = CRD["spec"]["versions"][0]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]
MINIMAL = {"model": {"uri": "hf://Qwen/Qwen3-30B-A3B", "servedName": "qwen3"}}


# ---- the API server's checks, offline ----------------------------------------------------------


def with_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting: a missing property with a default gets it, then its own defaults."""
    if isinstance(value, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = with_defaults(sub, value[key])
    if isinstance(value, list) and "items" in schema:
        return [with_defaults(schema["items"], v) for v in value]
    return value


def as_json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """int-or-string as anyOf; objects with properties reject unknown fields (kubectl's strict validation)."""
    result = {k: v for k, v in schema.items() if not k.startswith("x-kubernetes") and k != "default"}
    if schema.get("x-kubernetes-int-or-string"):
        result["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if "properties" in schema:
        result["properties"] = {k: as_json_schema(v) for k, v in schema["properties"].items()}
        if not schema.get("x-kubernetes-preserve-unknown-fields") and "additionalProperties" not in schema:
            result["additionalProperties"] = False
    if "items" in schema:
        result["items"] = as_json_schema(schema["items"])
    if isinstance(schema.get("additionalProperties"), dict):
        result["additionalProperties"] = as_json_schema(schema["additionalProperties"])
    return result


def _quantity(text: celtypes.StringType) -> celtypes.DoubleType:
    # exact enough to order quantities as the API server's Quantity does ('1500m' < '2')
    return celtypes.DoubleType(float(quantity_value(str(text))))


def _is_greater_than(a: celtypes.DoubleType, b: celtypes.DoubleType) -> celtypes.BoolType:
    return celtypes.BoolType(a > b)


CEL_FUNCTIONS = {"quantity": _quantity, "isGreaterThan": _is_greater_than}


def cel_errors(schema: dict[str, Any], value: Any, where: str = "") -> list[str]:
    errors = []
    env = celpy.Environment()
    for rule in schema.get("x-kubernetes-validations", []):
        program = env.program(env.compile(rule["rule"]), functions=CEL_FUNCTIONS)
        if not program.evaluate({"self": celpy.json_to_cel(value)}):
            errors.append(f"{where}: {rule['message']}")
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                errors += cel_errors(sub, value[key], f"{where}.{key}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += cel_errors(schema["items"], item, f"{where}[{i}]")
    return errors


def admit(spec: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(the stored object, the API server's errors) for a ModelFleet with this spec."""
    obj = with_defaults(
        SCHEMA, {"apiVersion": "modelfleet.io/v1alpha1", "kind": "ModelFleet", "spec": copy.deepcopy(spec)}
    )
    errors = [
        f"{'.'.join(map(str, e.path))}: {e.message}" for e in OAS30Validator(as_json_schema(SCHEMA)).iter_errors(obj)
    ]
    return obj, errors or cel_errors(SCHEMA, obj)


# ---- good specs ------------------------------------------------------------------------------


def _with(**changes: Any) -> dict[str, Any]:
    return {**copy.deepcopy(MINIMAL), **changes}


GOOD = {
    "minimal": MINIMAL,
    "every field": {
        "model": {"uri": "pvc://models/qwen3-30b", "servedName": "qwen3", "formats": {"experts": "int4", "attention": "int8", "head": "int8"}},
        "backend": "torch", "accelerator": {"profile": "nvidia-gpu", "count": 2},
        "parallelism": {"pipeline": 2, "tensor": 2}, "stages": [{"layerStart": 0, "layerEnd": 20}, {"layerStart": 20, "layerEnd": 48}],
        "replicas": 2,
        "placement": {
            "nodeSelector": {"pool": "gpu"}, "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": {"podAntiAffinity": {}}, "numa": "single-numa-node",
        },
        "serving": {"maxStreams": 32, "contextLength": 8192, "windowRows": 16, "speculative": {
            "method": "hybrid", "numSpeculativeTokens": 6, "promptLookupMax": 5, "promptLookupMin": 2,
            "phraseTable": "/models/phrases.json", "phraseContext": 4, "adaptive": False, "minVerified": 16,
            "acceptanceThreshold": 0.5, "cooldownSteps": 32,
        }},
        "gateway": {"replicas": 2, "serviceType": "LoadBalancer", "apiKeysSecret": "keys", "maxQueue": 10, "queueTimeoutSeconds": 2.5},
        "restartPolicy": {"maxStageRestarts": 5}, "rollout": {"progressDeadlineSeconds": 1800},
        "resources": {"cpu": "500m", "memory": "24Gi"},
        "images": {"agent": "registry/agent:1", "gateway": "registry/gw:1", "pullPolicy": "Always"},
    },
    "openvino on intel igpus, auto pipeline": {
        "model": {"uri": "hostpath:///srv/models/ds", "servedName": "ds"}, "backend": "openvino",
        "accelerator": {"profile": "intel-igpu"}, "parallelism": {"pipeline": "auto"},
    },
    "hf model at a revision": {"model": {"uri": "hf://deepseek-ai/DeepSeek-V3@main", "servedName": "dsv3"}},
    "limits on stages and the gateway": _with(
        resources={"cpu": "500m", "memory": "8Gi", "cpuLimit": "2", "memoryLimit": "8Gi"},
        gateway={"resources": {"cpu": "250m", "memory": "512Mi", "cpuLimit": "1", "memoryLimit": "2Gi"}},
    ),
    "gated hf model through a mirror into a cache claim": {"model": {
        "uri": "hf://meta-llama/Llama-4-Scout", "servedName": "scout", "tokenSecret": {"name": "hf", "key": "token"},
        "cache": {"claimName": "hf-cache"}, "endpoint": "https://hub.mirror.internal/hf",
    }},
}  # fmt: skip


@pytest.mark.parametrize("spec", GOOD.values(), ids=GOOD.keys())
def test_good_specs_pass_the_crd_and_parse(spec):
    stored, errors = admit(spec)
    assert errors == []
    assert parse_spec(stored["spec"]) == parse_spec(spec)


def test_crd_defaults_are_the_spec_defaults():
    stored, _ = admit(MINIMAL)
    defaults = ModelFleetSpec.model_validate(MINIMAL).model_dump(mode="json", by_alias=True, exclude_none=True)
    assert stored["spec"] == defaults


# ---- bad specs: both reject ------------------------------------------------------------------


BAD = {
    "unknown uri scheme": {"model": {"uri": "s3://bucket/model", "servedName": "m"}},
    "pvc without a path": {"model": {"uri": "pvc://models", "servedName": "m"}},
    "no served name": {"model": {"uri": "hf://a/b"}},
    "pipeline is neither int nor auto": _with(parallelism={"pipeline": "many"}),
    "pipeline zero": _with(parallelism={"pipeline": 0}),
    "tensor zero": _with(parallelism={"tensor": 0}),
    "window longer than context": _with(serving={"contextLength": 4, "windowRows": 8}),
    "torch on intel igpu": _with(accelerator={"profile": "intel-igpu"}),
    "openvino on nvidia": _with(backend="openvino", accelerator={"profile": "nvidia-gpu"}),
    "cpu with devices": _with(accelerator={"profile": "cpu", "count": 2}),
    "gpu with zero devices": _with(accelerator={"profile": "nvidia-gpu", "count": 0}),
    "stages with a gap": _with(stages=[{"layerStart": 0, "layerEnd": 4}, {"layerStart": 5, "layerEnd": 8}]),
    "stages not from zero": _with(stages=[{"layerStart": 1, "layerEnd": 4}]),
    "empty stage": _with(stages=[{"layerStart": 0, "layerEnd": 4}, {"layerStart": 4, "layerEnd": 4}]),
    "pipeline disagrees with stages": _with(parallelism={"pipeline": 3}, stages=[{"layerStart": 0, "layerEnd": 4}]),
    "unknown field": _with(replicaz=2),
    "replicas as text": _with(replicas="2"),
    "zero replicas": _with(replicas=0),
    "memory not a quantity": _with(resources={"memory": "lots"}),
    "zero memory": _with(resources={"memory": "0Gi"}),
    "cpu limit under the request": _with(resources={"cpu": "2", "cpuLimit": "1500m"}),
    "zero cpu limit": _with(resources={"cpuLimit": "0"}),
    "gateway memory limit under its default request": _with(gateway={"resources": {"memoryLimit": "512Mi"}}),
    "numa pinning with its own limits": _with(
        placement={"numa": "single-numa-node"}, resources={"cpu": "2", "memory": "8Gi", "cpuLimit": "4"}
    ),
    "zero queue timeout": _with(gateway={"queueTimeoutSeconds": 0}),
    "zero progress deadline": _with(rollout={"progressDeadlineSeconds": 0}),
    "unknown service type": _with(gateway={"serviceType": "Ingress"}),
    "unknown numa policy": _with(placement={"numa": "interleave"}),
    "numa pinning without resources": _with(placement={"numa": "single-numa-node"}, resources={"memory": "8Gi"}),
    "unknown weight format": {"model": {"uri": "hf://a/b", "servedName": "m", "formats": {"experts": "int3"}}},
    "unknown speculative method": _with(serving={"speculative": {"method": "medusa"}}),
    "speculative without a method": _with(serving={"speculative": {"numSpeculativeTokens": 4}}),
    "draft model without a model": _with(serving={"speculative": {"method": "draft_model"}}),
    "too many speculative tokens": _with(serving={"speculative": {"method": "ngram", "numSpeculativeTokens": 17}}),
    "suffix match shorter than its minimum": _with(
        serving={"speculative": {"method": "ngram", "promptLookupMin": 5, "promptLookupMax": 2}}
    ),
    "token secret for a pvc model": {
        "model": {"uri": "pvc://m/x", "servedName": "m", "tokenSecret": {"name": "hf", "key": "t"}}
    },
    "download cache for a host path": {
        "model": {"uri": "hostpath:///m", "servedName": "m", "cache": {"claimName": "c"}}
    },
    "token secret without a key": {"model": {"uri": "hf://a/b", "servedName": "m", "tokenSecret": {"name": "hf"}}},
    "endpoint not a url": {"model": {"uri": "hf://a/b", "servedName": "m", "endpoint": "mirror.local"}},
}


@pytest.mark.parametrize("spec", BAD.values(), ids=BAD.keys())
def test_bad_specs_are_rejected_by_the_crd_and_by_the_spec(spec):
    _, errors = admit(spec)
    assert errors, "the CRD admitted it"
    with pytest.raises(SpecError, match="invalid ModelFleet spec"):
        parse_spec(spec)


def test_spec_errors_name_the_crd_field():
    with pytest.raises(SpecError, match=r"serving.windowRows=8 exceeds serving.contextLength=4"):
        parse_spec(_with(serving={"contextLength": 4, "windowRows": 8}))
    with pytest.raises(SpecError, match=r"stages\[1\].layerStart=5 must be 4"):
        parse_spec(BAD["stages with a gap"])


# ---- names -----------------------------------------------------------------------------------


def _field_names(model: type) -> dict[str, Any]:
    from pydantic import BaseModel

    result: dict[str, Any] = {}
    for name, info in model.model_fields.items():  # type: ignore[attr-defined]
        args = [info.annotation, *getattr(info.annotation, "__args__", ())]
        nested = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        for a in getattr(info.annotation, "__args__", ()):  # tuple[X, ...] | None
            nested += [b for b in getattr(a, "__args__", ()) if isinstance(b, type) and issubclass(b, BaseModel)]
        result[info.alias or name] = _field_names(nested[0]) if nested else None
    return result


def _schema_names(schema: dict[str, Any]) -> dict[str, Any] | None:
    if "items" in schema:
        return _schema_names(schema["items"])
    if "properties" not in schema:
        return None
    return {k: _schema_names(v) for k, v in schema["properties"].items()}


def test_crd_fields_and_spec_fields_have_the_same_names():
    assert _schema_names(SCHEMA["properties"]["spec"]) == _field_names(ModelFleetSpec)


def test_crd_serves_status_scale_and_the_printer_columns():
    assert VERSION["subresources"]["status"] == {}
    assert VERSION["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    assert [c["name"] for c in VERSION["additionalPrinterColumns"]] == ["Phase", "Ready", "Stages", "Endpoint", "Age"]
    conditions = SCHEMA["properties"]["status"]["properties"]["conditions"]["items"]["properties"]["type"]["enum"]
    assert conditions == [
        "ModelInspected",
        "Planned",
        "Scheduled",
        "WeightsLoaded",
        "ChainReady",
        "GatewayReady",
        "Ready",
        "Progressing",
    ]


def _defaults(schema: dict[str, Any], where: str = "") -> list[tuple[str, dict[str, Any], Any]]:
    found = [(where, schema, schema["default"])] if "default" in schema else []
    for key, sub in schema.get("properties", {}).items():
        found += _defaults(sub, f"{where}.{key}")
    if "items" in schema:
        found += _defaults(schema["items"], f"{where}[]")
    return found


def test_every_default_is_valid_under_its_own_schema_once_defaulted():
    # the API server rejects a CRD whose defaults, after defaulting and pruning, fail their schema
    for where, schema, default in _defaults(SCHEMA):
        value = with_defaults(schema, copy.deepcopy(default))
        assert list(OAS30Validator(as_json_schema(schema)).iter_errors(value)) == [], where
        assert cel_errors(schema, value, where) == []


def test_the_schema_is_structural_every_field_has_a_type():
    def untyped(schema: dict[str, Any], where: str) -> list[str]:
        typed = "type" in schema or schema.get("x-kubernetes-int-or-string")
        found = [] if typed else [where]
        for key, sub in schema.get("properties", {}).items():
            found += untyped(sub, f"{where}.{key}")
        for key in ("items", "additionalProperties"):
            if isinstance(schema.get(key), dict):
                found += untyped(schema[key], f"{where}.{key}")
        return found

    assert untyped(SCHEMA, "") == []


def test_the_crd_limits_the_fleet_name_as_the_operator_does():
    from modelfleet.operator.names import MAX_FLEET_NAME_LENGTH

    stored, _ = admit(MINIMAL)
    for length, admitted in ((MAX_FLEET_NAME_LENGTH, True), (MAX_FLEET_NAME_LENGTH + 1, False)):
        errors = cel_errors(SCHEMA, {**stored, "metadata": {"name": "q" * length}})
        assert (errors == []) is admitted, errors
