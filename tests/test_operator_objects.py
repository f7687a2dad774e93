"""Object builders: the Kubernetes objects of a fleet, and `modelfleet render` printing them."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from fleet_fixtures import fleet, node, summary
from typer.testing import CliRunner

from modelfleet.cli import app
from modelfleet.operator import objects
from modelfleet.operator.placement import Placement, place
from modelfleet.operator.spec import parse_spec
from modelfleet.plan import FleetPlan


def build(**spec_fields: Any) -> tuple[dict[str, Any], list[dict[str, Any]], Placement]:
    body = fleet(**spec_fields)
    spec = parse_spec(body["spec"])
    nodes = [node(n, allocatable={"nvidia.com/gpu": "1"}) for n in ("a", "b", "c", "d")]
    placement = place(spec, summary(8), nodes, "qwen", "ai")
    assert isinstance(placement, Placement)
    return body, objects.fleet_objects(body, spec, placement), placement


def by_kind(objs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def env_of(pod: dict[str, Any]) -> dict[str, str]:
    pod_spec = pod.get("spec", pod)
    return {e["name"]: e.get("value", "<ref>") for e in pod_spec["containers"][0]["env"]}


def test_one_pod_per_stage_member_named_and_labelled_with_the_revision_and_mf_environment():
    _, objs, placement = build(parallelism={"pipeline": 2}, replicas=2)
    pods, rev = by_kind(objs, "Pod"), placement.revision
    assert sorted(pods) == [f"qwen-{rev}-g0-s0", f"qwen-{rev}-g0-s1", f"qwen-{rev}-g1-s0", f"qwen-{rev}-g1-s1"]
    pod = pods[f"qwen-{rev}-g1-s1"]
    assert pod["metadata"]["labels"] == {
        "modelfleet.io/fleet": "qwen", "modelfleet.io/group": "1", "modelfleet.io/stage-index": "1",
        "modelfleet.io/tp-rank": "0", "modelfleet.io/revision": rev, "modelfleet.io/component": "stage",
    }  # fmt: skip
    env = env_of(pod)
    assert {k: env[k] for k in ("MF_FLEET", "MF_REVISION", "MF_STAGE_INDEX", "MF_LAYER_START", "MF_LAYER_END")} == {
        "MF_FLEET": "qwen", "MF_REVISION": rev, "MF_STAGE_INDEX": "1", "MF_LAYER_START": "4", "MF_LAYER_END": "8",
    }  # fmt: skip
    # what `modelfleet agent` reads
    assert (env["MF_PLAN"], env["MF_GROUP"], env["MF_STAGE"]) == ("/etc/modelfleet/plan.json", "1", "1")
    assert (env["MF_MODEL_PATH"], env["MF_KEYS_DIR"]) == ("/models/qwen3", "/etc/modelfleet-transport")
    transport = {"secretName": "qwen-transport", "defaultMode": 0o400}
    assert {"name": "transport", "secret": transport} in pod["spec"]["volumes"]
    assert (pod["spec"]["hostname"], pod["spec"]["subdomain"]) == (f"qwen-{rev}-g1-s1", "qwen-stages")
    assert placement.plan.stage(1, 0).address == f"qwen-{rev}-g1-s0.qwen-stages.ai.svc:5555"


def test_tensor_parallel_members_get_a_rank_suffix():
    _, objs, placement = build(parallelism={"pipeline": 2, "tensor": 2})
    rev = placement.revision
    pods = by_kind(objs, "Pod")
    assert sorted(pods) == [f"qwen-{rev}-g0-s{s}-r{r}" for s in (0, 1) for r in (0, 1)]
    for r in (0, 1):  # every rank answers its probes on its own pod's HTTP port
        pod_spec = pods[f"qwen-{rev}-g0-s1-r{r}"]["spec"]
        container = pod_spec["containers"][0]
        assert (env_of(pod_spec)["MF_TP_RANK"], container["readinessProbe"]["httpGet"]["port"]) == (str(r), 5556)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports == ({"agent": 5555, "http": 5556, "tensor": 5558} if r == 0 else {"agent": 5555, "http": 5556})
    # ranks reach rank 0's rendezvous (port + 3) and each other's gloo links: any port within the fleet
    assert by_kind(objs, "NetworkPolicy")["qwen-stages"]["spec"]["ingress"][0] == {
        "from": [{"podSelector": {"matchLabels": {"modelfleet.io/fleet": "qwen"}}}]
    }


def test_pods_run_unprivileged_on_a_read_only_root_with_a_scratch_directory():
    _, objs, _ = build()
    pod_specs = [p["spec"] for p in by_kind(objs, "Pod").values()]
    pod_specs.append(by_kind(objs, "Deployment")["qwen-gateway"]["spec"]["template"]["spec"])
    for pod_spec in pod_specs:
        assert pod_spec["securityContext"]["runAsNonRoot"] is True
        container = pod_spec["containers"][0]
        assert container["securityContext"] == {
            "runAsNonRoot": True, "readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        }  # fmt: skip
        assert {"name": "scratch", "mountPath": "/tmp"} in container["volumeMounts"]
        assert env_of(pod_spec)["HOME"] == "/tmp"


def test_the_startup_probe_allows_for_loading_the_stages_weights():
    _, objs, placement = build(parallelism={"pipeline": 2})
    container = next(iter(by_kind(objs, "Pod").values()))["spec"]["containers"][0]
    startup = container["startupProbe"]
    weights = placement.plan.stage(0, 0).weights_bytes  # 4 GiB
    budget_seconds = startup["periodSeconds"] * startup["failureThreshold"]
    assert startup["httpGet"]["path"] == "/healthz"
    assert 300 + weights / 50e6 <= budget_seconds < 300 + weights / 50e6 + 10
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_a_pod_is_bound_to_its_planned_node_and_mounts_the_plan_with_probes():
    _, objs, placement = build(
        parallelism={"pipeline": 2},
        placement={"affinity": {"podAntiAffinity": {"x": 1}}},
    )
    pod = by_kind(objs, "Pod")[f"qwen-{placement.revision}-g0-s1"]
    term = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ][0]
    assert term["matchFields"] == [
        {
            "key": "metadata.name",
            "operator": "In",
            "values": [placement.members[1].node],
        }
    ]
    assert pod["spec"]["affinity"]["podAntiAffinity"] == {"x": 1}  # the user's affinity is kept
    container = pod["spec"]["containers"][0]
    assert {"name": "plan", "configMap": {"name": f"qwen-plan-{placement.revision}"}} in pod["spec"]["volumes"]
    assert {
        "name": "plan",
        "mountPath": "/etc/modelfleet",
        "readOnly": True,
    } in container["volumeMounts"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert pod["spec"]["restartPolicy"] == "Never"


def test_resources_are_strings_with_the_accelerator_and_guaranteed_whole_cpus_for_numa_pinning():
    _, objs, _ = build(
        accelerator={"profile": "nvidia-gpu", "count": 1}, resources={"cpu": "3500m", "memory": "16Gi"},
        placement={"numa": "single-numa-node"},
    )  # fmt: skip
    resources = next(iter(by_kind(objs, "Pod").values()))["spec"]["containers"][0]["resources"]
    assert resources == {
        "requests": {"cpu": "4", "memory": "16Gi"},
        "limits": {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "1"},
    }


def test_without_numa_pinning_cpu_is_requested_as_given_and_not_limited():
    _, objs, _ = build(resources={"cpu": "500m", "memory": "16Gi"})
    resources = next(iter(by_kind(objs, "Pod").values()))["spec"]["containers"][0]["resources"]
    assert resources == {"requests": {"cpu": "500m", "memory": "16Gi"}, "limits": {"memory": "16Gi"}}


def test_limits_are_settable_for_stage_pods_and_the_gateway():
    _, objs, _ = build(
        resources={"cpu": "2", "memory": "16Gi", "cpuLimit": "4", "memoryLimit": "20Gi"},
        gateway={"resources": {"cpu": "1", "memory": "2Gi", "cpuLimit": "2"}},
    )  # fmt: skip
    stage = next(iter(by_kind(objs, "Pod").values()))["spec"]["containers"][0]["resources"]
    assert stage == {"requests": {"cpu": "2", "memory": "16Gi"}, "limits": {"cpu": "4", "memory": "20Gi"}}
    gateway = by_kind(objs, "Deployment")["qwen-gateway"]["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert gateway == {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"cpu": "2", "memory": "2Gi"}}


def test_without_resources_a_cpu_stage_requests_one_core_and_its_planned_bytes_and_the_gateway_its_defaults():
    _, objs, placement = build()
    stage = placement.plan.groups[0].stages[0]
    need_mib = -(-(stage.weights_bytes + stage.kv_budget_bytes + objects.STAGE_RUNTIME_BYTES) // 2**20)
    pod = next(p for p in by_kind(objs, "Pod").values() if p["metadata"]["labels"]["modelfleet.io/stage-index"] == "0")
    assert pod["spec"]["containers"][0]["resources"] == {
        "requests": {"cpu": "1", "memory": f"{need_mib}Mi"}, "limits": {"memory": f"{need_mib}Mi"},
    }  # fmt: skip
    gateway = by_kind(objs, "Deployment")["qwen-gateway"]["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert gateway == {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "1Gi"}}
    _, gpu_objs, _ = build(accelerator={"profile": "nvidia-gpu"})
    gpu = next(iter(by_kind(gpu_objs, "Pod").values()))["spec"]["containers"][0]["resources"]
    assert gpu == {"requests": {"cpu": "1"}, "limits": {"nvidia.com/gpu": "1"}}  # device vs host bytes: the engine's


def test_plan_config_map_holds_the_plan_and_its_hash():
    _, objs, placement = build()
    config_map = by_kind(objs, "ConfigMap")["qwen-plan"]
    plan = FleetPlan.from_json(config_map["data"]["plan.json"])
    assert plan == placement.plan
    assert plan.model.path == "/models/qwen3"  # where every pod mounts pvc://models/qwen3
    assert config_map["metadata"]["annotations"]["modelfleet.io/plan-hash"] == plan.plan_hash()
    assert [m["node"] for m in json.loads(config_map["data"]["members.json"])] == [
        "a",
        "b",
        "c",
        "d",
    ]


def test_services_gateway_policies_and_budget():
    body, objs, _ = build(gateway={"replicas": 2, "serviceType": "NodePort", "apiKeysSecret": "keys"})
    services = by_kind(objs, "Service")
    assert services["qwen-stages"]["spec"]["clusterIP"] == "None"
    assert services["qwen-stages"]["spec"]["publishNotReadyAddresses"] is True
    assert services["qwen-gateway"]["spec"]["type"] == "NodePort"
    deployment = by_kind(objs, "Deployment")["qwen-gateway"]
    assert deployment["spec"]["replicas"] == 2
    gateway_pod = deployment["spec"]["template"]["spec"]
    api_keys = {
        "secretName": "keys",
        "items": [{"key": "api-keys", "path": "api-keys"}],
    }
    assert {"name": "api-keys", "secret": api_keys} in gateway_pod["volumes"]
    assert env_of(gateway_pod)["MF_API_KEYS_FILE"] == "/etc/modelfleet-api-keys/api-keys"
    assert env_of(gateway_pod)["MF_KEYS_DIR"] == "/etc/modelfleet-transport"
    policies = by_kind(objs, "NetworkPolicy")
    operator = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "modelfleet-system"}},
        "podSelector": {
            "matchLabels": {"app.kubernetes.io/name": "modelfleet", "app.kubernetes.io/component": "operator"}
        },
    }
    monitoring = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        "podSelector": {},
    }
    assert policies["qwen-stages"]["spec"]["ingress"] == [
        {"from": [{"podSelector": {"matchLabels": {"modelfleet.io/fleet": "qwen"}}}]},
        {"ports": [{"protocol": "TCP", "port": 5556}], "from": [operator, monitoring]},  # health, status and metrics
    ]
    assert policies["qwen-gateway"]["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8000}]}]
    assert by_kind(objs, "PodDisruptionBudget")["qwen-stages"]["spec"]["maxUnavailable"] == 1
    assert objects.endpoint(body) == "http://qwen-gateway.ai.svc:8000/v1"


def test_every_object_is_owned_by_the_fleet_and_labelled_with_it():
    _, objs, _ = build()
    owner = {
        "apiVersion": "modelfleet.io/v1alpha1",
        "kind": "ModelFleet",
        "name": "qwen",
        "uid": "uid-qwen",
        "controller": True,
        "blockOwnerDeletion": True,
    }
    for obj in objs:
        assert obj["metadata"]["ownerReferences"] == [owner]
        assert obj["metadata"]["labels"]["modelfleet.io/fleet"] == "qwen"
        assert obj["metadata"]["namespace"] == "ai"


@pytest.mark.parametrize("kind, model", [("Pod", "V1Pod"), ("Service", "V1Service"), ("ConfigMap", "V1ConfigMap"), ("Deployment", "V1Deployment"), ("NetworkPolicy", "V1NetworkPolicy"), ("PodDisruptionBudget", "V1PodDisruptionBudget")])  # fmt: skip
def test_objects_deserialize_as_kubernetes_models_with_string_quantities(kind, model):
    from kubernetes.client import ApiClient

    _, objs, _ = build(resources={"cpu": "1", "memory": "2Gi"})
    client = ApiClient()
    for obj in by_kind(objs, kind).values():
        typed = client._ApiClient__deserialize(obj, model)  # type: ignore[attr-defined]
        assert client.sanitize_for_serialization(typed) == obj
        assert not any(isinstance(v, float) for v in _leaves(obj))


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if isinstance(value, list):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


# ---- modelfleet render ------------------------------------------------------------------------


def test_render_prints_the_objects_the_operator_would_create(tmp_path):
    body = fleet(parallelism={"pipeline": 2})
    del body["metadata"]["uid"]
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(body))
    (tmp_path / "nodes.yaml").write_text(yaml.safe_dump({"kind": "List", "items": [node("a"), node("b")]}))
    (tmp_path / "summary.json").write_text(summary(8).model_dump_json())
    args = [
        "render",
        "--fleet",
        str(tmp_path / "fleet.yaml"),
        "--nodes",
        str(tmp_path / "nodes.yaml"),
    ]
    result = CliRunner().invoke(app, [*args, "--model-summary", str(tmp_path / "summary.json")])
    assert result.exit_code == 0, result.output
    docs = list(yaml.safe_load_all(result.output))
    assert [d["kind"] for d in docs].count("Pod") == 2
    plan = FleetPlan.from_json(docs[0]["data"]["plan.json"])
    assert [(s.layer_start, s.layer_end) for s in plan.groups[0].stages] == [
        (0, 4),
        (4, 8),
    ]


def test_render_of_an_infeasible_fleet_names_the_reason_and_nodes(tmp_path):
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(fleet(accelerator={"profile": "nvidia-gpu"})))
    (tmp_path / "nodes.yaml").write_text(yaml.safe_dump_all([node("a"), node("b")]))
    (tmp_path / "summary.json").write_text(summary(8).model_dump_json())
    args = [
        "render",
        "--fleet",
        str(tmp_path / "fleet.yaml"),
        "--nodes",
        str(tmp_path / "nodes.yaml"),
    ]
    result = CliRunner().invoke(app, [*args, "--model-summary", str(tmp_path / "summary.json")])
    assert result.exit_code == 2
    assert "NoMatchingNodes" in result.output and "nodes considered: a, b" in result.output


def test_inspect_summarises_a_checkpoint_from_its_headers(tmp_path, tiny_checkpoint):
    from modelfleet.operator.summary import ModelSummary
    from modelfleet.planner import layer_bytes

    path, _ = tiny_checkpoint("qwen3_moe")
    result = CliRunner().invoke(
        app,
        ["inspect", "--model", str(path), "--output", str(tmp_path / "summary.json")],
    )
    assert result.exit_code == 0, result.output
    inspected = ModelSummary.from_json((tmp_path / "summary.json").read_text())
    sizes = layer_bytes(path, "bfloat16")
    assert (inspected.layer_bytes, inspected.embed_bytes, inspected.tied) == (
        sizes.per_layer,
        sizes.embed_bytes,
        sizes.tied,
    )
    assert inspected.kv_bytes(1, 1)[0] == 2 * 2 * 16 * 2  # K and V, 2 kv heads x head_dim 16, bf16


def test_inspect_of_a_missing_checkpoint_reports_the_error_where_asked(tmp_path):
    result = CliRunner().invoke(
        app,
        [
            "inspect",
            "--model",
            str(tmp_path / "nowhere"),
            "--output",
            str(tmp_path / "log"),
        ],
    )
    assert result.exit_code == 2
    assert str(tmp_path / "nowhere") in (tmp_path / "log").read_text()


def test_the_inspection_job_reads_the_model_volume_and_reports_through_its_termination_message():
    from kubernetes.client import ApiClient

    body = fleet(model={"uri": "hostpath:///srv/models/qwen3", "servedName": "qwen3"})
    job = objects.inspection_job(body, parse_spec(body["spec"]))
    pod_spec = job["spec"]["template"]["spec"]
    assert pod_spec["volumes"] == [
        {"name": "model", "hostPath": {"path": "/srv/models/qwen3", "type": "Directory"}},
        {"name": "scratch", "emptyDir": {}},  # the root filesystem is read-only
    ]
    assert pod_spec["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    assert "--output /dev/termination-log" in pod_spec["containers"][0]["command"][-1]
    assert pod_spec["restartPolicy"] == "Never" and pod_spec["automountServiceAccountToken"] is False
    client = ApiClient()
    assert client.sanitize_for_serialization(client._ApiClient__deserialize(job, "V1Job")) == job  # type: ignore[attr-defined]


def test_every_built_object_and_the_crd_pass_strict_kubernetes_schema_validation():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    from pathlib import Path

    body, objs, _ = build(
        parallelism={"pipeline": 2, "tensor": 2}, resources={"cpu": "2", "memory": "8Gi"},
        gateway={"apiKeysSecret": "keys"}, placement={"tolerations": [{"key": "gpu", "operator": "Exists"}]},
    )  # fmt: skip
    spec = parse_spec(body["spec"])
    crd = yaml.safe_load((Path(__file__).parents[1] / "crds" / "modelfleets.modelfleet.io.yaml").read_text())
    extra = [
        objects.inspection_job(body, spec),
        objects.transport_secret(body, "p" * 40, "s" * 40),
        crd,
    ]
    for obj in objs + extra:
        kubernetes_validate.validate(obj, "1.31", strict=True)


def test_pods_keep_the_users_pod_affinity_and_preferred_node_affinity_and_pass_strict_validation():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    spread = {
        "labelSelector": {"matchLabels": {"modelfleet.io/fleet": "qwen"}},
        "topologyKey": "kubernetes.io/hostname",
    }
    zone = {"labelSelector": {"matchLabels": {"app": "cache"}}, "topologyKey": "topology.kubernetes.io/zone"}
    preferred = [
        {"weight": 10, "preference": {"matchExpressions": [{"key": "disk", "operator": "In", "values": ["ssd"]}]}}
    ]
    affinity = {
        "nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": preferred},
        "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [spread]},
        "podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [zone]},
    }
    _, objs, placement = build(parallelism={"pipeline": 2}, placement={"affinity": affinity})
    for pod in by_kind(objs, "Pod").values():
        kept = pod["spec"]["affinity"]
        assert kept["podAntiAffinity"] == affinity["podAntiAffinity"] and kept["podAffinity"] == affinity["podAffinity"]
        assert kept["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] == preferred
        kubernetes_validate.validate(pod, "1.31", strict=True)


@pytest.mark.parametrize("args", [[], ["--namespace", "ai", "--all-namespaces"]])
def test_the_operator_command_needs_namespaces_or_all_of_them(args):
    result = CliRunner().invoke(app, ["operator", *args])
    assert result.exit_code == 2 and "--namespace NS" in result.output


# ---- hf:// models ------------------------------------------------------------------------------

HF_GATED = {
    "uri": "hf://org/tiny@v1", "servedName": "tiny", "tokenSecret": {"name": "hf", "key": "token"},
    "cache": {"claimName": "hf-cache"}, "endpoint": "https://mirror.example/hf",
}  # fmt: skip


def test_an_hf_stage_pod_fetches_the_model_in_an_init_container_into_the_path_the_agent_reads():
    _, objs, placement = build(model=HF_GATED, parallelism={"pipeline": 2})
    pod = next(iter(by_kind(objs, "Pod").values()))
    (fetch,) = pod["spec"]["initContainers"]
    assert fetch["command"] == ["modelfleet", "fetch", "hf://org/tiny@v1", "--out", "/models/org/tiny@v1"]
    assert env_of(pod)["MF_MODEL_PATH"] == placement.plan.model.path == "/models/org/tiny@v1"
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "hf-cache"}} in pod["spec"]["volumes"]
    assert {"name": "model", "mountPath": "/models"} in fetch["volumeMounts"]  # the fetch writes, the agent reads
    agent_mount = next(m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "model")
    assert agent_mount["readOnly"] is True
    env = {e["name"]: e for e in fetch["env"]}
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert env["HF_ENDPOINT"]["value"] == "https://mirror.example/hf"
    assert env["HF_HOME"]["value"].startswith("/tmp/") and fetch["securityContext"]["readOnlyRootFilesystem"]


def test_an_hf_model_without_a_cache_claim_downloads_into_an_empty_dir_and_needs_no_token():
    _, objs, _ = build(model={"uri": "hf://org/tiny", "servedName": "tiny"})
    pod = next(iter(by_kind(objs, "Pod").values()))
    assert {"name": "model", "emptyDir": {}} in pod["spec"]["volumes"]
    names_in_env = {e["name"] for e in pod["spec"]["initContainers"][0]["env"]}
    assert "HF_TOKEN" not in names_in_env and "HF_ENDPOINT" not in names_in_env


def test_the_gateway_of_an_hf_model_fetches_only_config_and_tokenizer():
    _, objs, _ = build(model=HF_GATED)
    template = next(iter(by_kind(objs, "Deployment").values()))["spec"]["template"]["spec"]
    (fetch,) = template["initContainers"]
    assert fetch["command"][-1] == "--no-weights" and fetch["command"][2] == "hf://org/tiny@v1"


def test_local_models_get_no_init_container():
    _, objs, _ = build()
    assert all("initContainers" not in p["spec"] for p in by_kind(objs, "Pod").values())


def test_the_inspection_job_of_an_hf_model_reads_headers_over_http_with_no_volume():
    body = fleet(model=HF_GATED)
    job = objects.inspection_job(body, parse_spec(body["spec"]))
    pod_spec = job["spec"]["template"]["spec"]
    assert pod_spec["volumes"] == [{"name": "scratch", "emptyDir": {}}]
    (container,) = pod_spec["containers"]
    assert 'modelfleet inspect --model "$MF_MODEL_URI" --output /dev/termination-log' in container["command"][-1]
    env = {e["name"]: e for e in container["env"]}
    assert env["MF_MODEL_URI"]["value"] == "hf://org/tiny@v1"
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert env["HF_ENDPOINT"]["value"] == "https://mirror.example/hf"


def test_network_policies_let_fleet_pods_reach_only_their_fleet_dns_and_for_hf_models_the_hubs_port():
    dns = {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}
    same_fleet = {"to": [{"podSelector": {"matchLabels": {"modelfleet.io/fleet": "qwen"}}}]}
    for model, hub in ((HF_GATED, [{"ports": [{"protocol": "TCP", "port": 443}]}]), (None, [])):
        _, objs, _ = build(**({"model": model} if model else {}))
        for policy in by_kind(objs, "NetworkPolicy").values():
            assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
            assert policy["spec"]["egress"] == [same_fleet, dns, *hub]
    _, objs, _ = build(model={"uri": "hf://org/tiny", "servedName": "tiny", "endpoint": "http://mirror.lan:8080/hf"})
    assert by_kind(objs, "NetworkPolicy")["qwen-stages"]["spec"]["egress"][-1] == {
        "ports": [{"protocol": "TCP", "port": 8080}]
    }


def test_the_stage_http_port_admits_the_operators_namespace_and_the_monitoring_pods_the_chart_names(monkeypatch):
    monkeypatch.setenv(objects.OPERATOR_NAMESPACE_ENV, "ops")
    monkeypatch.setenv(objects.MONITORING_NAMESPACE_ENV, "observability")
    monkeypatch.setenv(objects.MONITORING_POD_LABELS_ENV, "app.kubernetes.io/name=prometheus, team=sre")
    operator, monitoring = objects.http_peers()
    assert operator["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "ops"}}
    assert monitoring == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "observability"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus", "team": "sre"}},
    }
    monkeypatch.setenv(objects.MONITORING_POD_LABELS_ENV, "prometheus")
    with pytest.raises(ValueError, match="MF_MONITORING_POD_LABELS: 'prometheus' is not key=value"):
        objects.http_peers()


@pytest.mark.parametrize("model", [HF_GATED, {"uri": "hf://org/tiny", "servedName": "tiny"}], ids=["gated", "public"])
def test_every_object_of_an_hf_fleet_passes_strict_kubernetes_schema_validation(model):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    body, objs, _ = build(model=model, parallelism={"pipeline": 2})
    for obj in [*objs, objects.inspection_job(body, parse_spec(body["spec"]))]:
        kubernetes_validate.validate(obj, "1.31", strict=True)


def test_render_of_an_hf_fleet_with_a_local_stand_in_for_inspection(tmp_path, tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3_moe")
    body = fleet(model=HF_GATED, serving={"contextLength": 512})  # the tiny model's positions
    del body["metadata"]["uid"]
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(body))
    (tmp_path / "nodes.yaml").write_text(yaml.safe_dump({"kind": "List", "items": [node("a")]}))
    args = ["render", "--fleet", str(tmp_path / "fleet.yaml"), "--nodes", str(tmp_path / "nodes.yaml")]
    result = CliRunner().invoke(app, [*args, "--model", str(path)])
    assert result.exit_code == 0, result.output
    docs = list(yaml.safe_load_all(result.output))
    pods = [d for d in docs if d["kind"] == "Pod"]
    assert pods and all(p["spec"]["initContainers"][0]["name"] == "fetch" for p in pods)
    plan = FleetPlan.from_json(next(d for d in docs if d["kind"] == "ConfigMap")["data"]["plan.json"])
    assert plan.model.path == "/models/org/tiny@v1"


def test_a_numa_pinned_hf_pod_stays_guaranteed_its_fetch_has_the_agents_cpu_and_memory_and_no_gpu():
    _, objs, _ = build(
        model=HF_GATED, accelerator={"profile": "nvidia-gpu"}, placement={"numa": "single-numa-node"},
        resources={"cpu": "2", "memory": "8Gi"},
    )  # fmt: skip
    pod = next(iter(by_kind(objs, "Pod").values()))
    agent, fetch = pod["spec"]["containers"][0], pod["spec"]["initContainers"][0]
    assert agent["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert fetch["resources"] == {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"cpu": "2", "memory": "8Gi"}}


@pytest.mark.parametrize(
    ("profile", "allocatable", "device", "resource"),
    [("intel-igpu", {"gpu.intel.com/xe": "1"}, "GPU", "gpu.intel.com/xe"), ("cpu", {}, "cpu", None)],
)
def test_backend_openvino_gives_stage_pods_that_run_it_on_the_openvino_image(
    monkeypatch: pytest.MonkeyPatch, profile: str, allocatable: dict[str, str], device: str, resource: str | None
) -> None:
    monkeypatch.setenv("MF_AGENT_IMAGE_INTEL_IGPU", "ghcr.io/modelfleet/agent-openvino:0.1.0")
    monkeypatch.setenv("MF_AGENT_IMAGE_CPU", "ghcr.io/modelfleet/agent-cpu:0.1.0")
    body = fleet(backend="openvino", accelerator={"profile": profile}, parallelism={"pipeline": 2})
    spec = parse_spec(body["spec"])
    placement = place(spec, summary(8), [node(n, allocatable=allocatable) for n in ("a", "b")], "qwen", "ai")
    assert isinstance(placement, Placement)
    stages = placement.plan.groups[0].stages
    assert [(s.backend, s.device) for s in stages] == [("openvino", device)] * 2
    for pod in by_kind(objects.fleet_objects(body, spec, placement), "Pod").values():
        container = pod["spec"]["containers"][0]
        assert container["image"] == "ghcr.io/modelfleet/agent-openvino:0.1.0"
        assert container["command"] == ["modelfleet", "agent"]
        assert env_of(pod)["MF_OPENVINO_CACHE_DIR"] == "/tmp/openvino"  # on the pod's scratch volume
        limits = container["resources"].get("limits", {})
        assert (resource in limits) if resource else not any("gpu" in k for k in limits)
