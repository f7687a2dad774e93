"""What an auditor checks in what we install: checkov over the rendered chart and every example
fleet (``modelfleet render``) finds nothing but the skips ``.checkov.yaml`` justifies, a pinned
render passes the digest checks those skips waive, and the defaults checkov has no rule for hold:
every pod has CPU and memory requests and a high UID, a stage's HTTP port admits only the operator
and the scrapers, a gateway reachable from outside the cluster takes API keys, and the default
images are the ones ``images/build.sh`` builds.

checkov sits in a venv of its own (``.venv/checkov``, made by ``scripts/setup.sh test``: its
pinned dependencies conflict with the project's), or ``$MF_CHECKOV``; without it the checkov tests
skip. helm as in tests/test_chart.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_chart import CHART, needs_helm
from test_chart import render as render_chart
from test_examples import NAMES
from test_examples import render as render_example

from modelfleet import __version__
from modelfleet.operator import names, objects

ROOT = Path(__file__).parents[1]
CONFIG = ROOT / ".checkov.yaml"
DIGEST = f"sha256:{'b' * 64}"
DIGEST_CHECKS = "CKV_K8S_43,CKV_K8S_15"


def _find_checkov() -> str | None:
    candidate = os.environ.get("MF_CHECKOV") or str(ROOT / ".venv" / "checkov" / "bin" / "checkov")
    return candidate if Path(candidate).is_file() and os.access(candidate, os.X_OK) else shutil.which("checkov")


CHECKOV = _find_checkov()
needs_checkov = pytest.mark.skipif(
    CHECKOV is None, reason="no checkov: run `bash scripts/setup.sh test` (it makes .venv/checkov) or set MF_CHECKOV"
)


def checkov(directory: Path, *args: str) -> dict[str, Any]:
    """checkov's JSON report over every YAML file in ``directory``, with the repository's settings."""
    assert CHECKOV is not None
    command = [CHECKOV, "--config-file", str(CONFIG), "-d", str(directory), "-o", "json", *args]
    # its own venv, run from the scratch directory: the repository's operator/ must not shadow the stdlib
    env = {**os.environ, "PYTHONSAFEPATH": "1", "BC_SKIP_MAPPING": "TRUE"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=directory, env=env, check=False)
    assert result.stdout.strip(), result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert isinstance(report, dict) and report["summary"]["parsing_errors"] == 0, result.stdout[:2000]
    return report


def findings(report: dict[str, Any]) -> list[str]:
    return [f"{c['check_id']} {c['check_name']}: {c['resource']} ({c['file_path']})" for c in report["results"]["failed_checks"]]  # fmt: skip


def write_renders(directory: Path) -> list[str]:
    """The chart as `helm install -n modelfleet-system` renders it and every example fleet, one file each."""
    (directory / "chart.yaml").write_text(yaml.safe_dump_all(render_chart()))
    for name in NAMES:
        (directory / f"{name}.yaml").write_text(yaml.safe_dump_all(render_example(name)))
    return sorted(p.name for p in directory.glob("*.yaml"))


def pods_of(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(name, pod spec) of every Pod and workload's pod template."""
    found = []
    for doc in docs:
        if doc["kind"] == "Pod":
            found.append((doc["metadata"]["name"], doc["spec"]))
        elif doc["kind"] in ("Deployment", "Job"):
            found.append((doc["metadata"]["name"], doc["spec"]["template"]["spec"]))
    return found


# ---- checkov ----------------------------------------------------------------------------------


@needs_checkov
@needs_helm
def test_checkov_finds_nothing_in_the_chart_or_any_example_but_the_justified_skips(tmp_path: Path) -> None:
    rendered = write_renders(tmp_path)
    assert rendered == sorted(["chart.yaml", *(f"{n}.yaml" for n in NAMES)])
    report = checkov(tmp_path)
    assert report["summary"]["resource_count"] > 50 and report["summary"]["passed"] > 1000
    assert findings(report) == []


@needs_checkov
@needs_helm
def test_a_render_pinned_by_digest_passes_the_digest_checks_the_defaults_skip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the chart's images.*.digest; the operator hands the agent images to fleets' pods by environment
    pinned = [f"--set=images.{key}.digest={DIGEST}" for key in ("operator", "agentCpu", "agentCuda", "agentOpenvino")]
    (tmp_path / "chart.yaml").write_text(yaml.safe_dump_all(render_chart(*pinned)))
    for profile in objects.PROFILE_IMAGES:
        monkeypatch.setenv(objects.agent_image_env(profile), f"registry.local/agent@{DIGEST}")
    for name in NAMES:
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump_all(render_example(name)))
    report = checkov(tmp_path, "--check", DIGEST_CHECKS, "--skip-check", "NONE")
    assert findings(report) == [] and report["summary"]["passed"] > 20


def test_every_skip_in_the_checkov_settings_says_why() -> None:
    lines = CONFIG.read_text().splitlines()
    skips = [k for k, line in enumerate(lines) if re.match(r"\s*- CKV", line)]
    assert skips, "no skip-check entries found"
    for k in skips:
        reason = lines[k - 1].strip()
        previous_is_skip_or_comment = reason.startswith("#") or re.match(r"- CKV", reason)
        assert previous_is_skip_or_comment, f"{lines[k].strip()} has no comment above it"
    assert set(yaml.safe_load(CONFIG.read_text())["skip-check"]) == {"CKV_K8S_11", *DIGEST_CHECKS.split(",")}


# ---- what checkov does not check --------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_every_example_pod_requests_cpu_and_memory_and_runs_as_a_high_uid(name: str) -> None:
    for pod_name, pod in pods_of(render_example(name)):
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] >= 10000 and pod["securityContext"]["runAsGroup"] >= 10000
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            requests = container.get("resources", {}).get("requests", {})
            assert {"cpu", "memory"} <= set(requests), f"{pod_name}/{container['name']}: {container.get('resources')}"
            assert "memory" in container["resources"]["limits"], f"{pod_name}/{container['name']}"


@pytest.mark.parametrize("name", NAMES)
def test_a_stage_http_port_admits_only_its_fleet_the_operator_and_the_scrapers(name: str) -> None:
    docs = render_example(name)
    (stages,) = [d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-stages")]
    fleet = stages["spec"]["podSelector"]["matchLabels"][names.LABEL_FLEET]
    for rule in stages["spec"]["ingress"]:
        # a rule without `from` admits every pod in the cluster
        assert rule.get("from"), rule
        peers = rule["from"]
        if peers != [{"podSelector": {"matchLabels": {names.LABEL_FLEET: fleet}}}]:
            assert rule["ports"] == [{"protocol": "TCP", "port": names.AGENT_HTTP_PORT}]
            assert [p["namespaceSelector"]["matchLabels"] for p in peers] == [
                {"kubernetes.io/metadata.name": objects.DEFAULT_OPERATOR_NAMESPACE},
                {"kubernetes.io/metadata.name": objects.DEFAULT_MONITORING_NAMESPACE},
            ]
    assert "Egress" in stages["spec"]["policyTypes"]


@pytest.mark.parametrize("name", NAMES)
def test_an_example_gateway_reachable_from_outside_the_cluster_takes_api_keys(name: str) -> None:
    docs = render_example(name)
    (service,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-gateway")]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    env = {e["name"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    if service["spec"]["type"] != "ClusterIP":
        assert "MF_API_KEYS_FILE" in env, f"{name}: a {service['spec']['type']} gateway without apiKeysSecret"


@needs_helm
def test_the_chart_operator_and_build_script_name_the_same_images() -> None:
    build = (ROOT / "images" / "build.sh").read_text()
    registry = re.search(r"^REGISTRY=\$\{REGISTRY:-([^}]+)\}", build, re.M)
    built = re.search(r'^IMAGES=\$\{IMAGES:-"([^"]+)"\}', build, re.M)
    assert registry and built and registry.group(1) == objects.IMAGE_REGISTRY
    assert set(objects.PROFILE_IMAGES.values()) | {"operator"} == set(built.group(1).split())
    (deployment,) = [d for d in render_chart() if d["kind"] == "Deployment"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert container["image"] == f"{objects.IMAGE_REGISTRY}/operator:{__version__}"
    for profile in objects.PROFILE_IMAGES:
        assert env[objects.agent_image_env(profile)] == objects.default_image(profile)
    assert yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"] == __version__


@needs_helm
def test_the_chart_operator_pod_carries_the_labels_fleet_policies_admit() -> None:
    docs = render_chart()
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert objects.OPERATOR_POD_LABELS.items() <= labels.items()
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env[objects.OPERATOR_NAMESPACE_ENV]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    scrapers = render_chart("--set=metrics.scrapers.podLabels.app=prometheus", "--set=metrics.scrapers.namespace=obs")
    (deployment,) = [d for d in scrapers if d["kind"] == "Deployment"]
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert (env[objects.MONITORING_NAMESPACE_ENV], env[objects.MONITORING_POD_LABELS_ENV]) == ("obs", "app=prometheus")
