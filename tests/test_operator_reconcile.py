"""Reconcile passes against an in-memory API: plan, apply, observe, replace failed stages."""

from __future__ import annotations

import base64
import datetime as dt
import json
from typing import Any

import kopf
import pytest
from fleet_fixtures import FakeCluster, fleet, node, summary, summary_config_map, unrevised

from modelfleet.operator import handlers
from modelfleet.operator.reconcile import reconcile


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def cluster_for(body: dict[str, Any], nodes: list[dict[str, Any]] | None = None, layers: int = 8) -> FakeCluster:
    meta = body["metadata"]
    model = summary_config_map(meta["name"], meta["namespace"], summary(layers))
    return FakeCluster(nodes if nodes is not None else [node("a"), node("b")], [model])


def with_status(body: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
    return {**body, "status": status}


def test_an_hf_model_without_a_summary_is_inspected_over_http_by_a_job_without_a_volume():
    body = fleet(model={"uri": "hf://Qwen/Qwen3-30B-A3B", "servedName": "qwen3"})
    cluster = FakeCluster([node("a")])
    outcome = reconcile(body, cluster)
    assert conditions(outcome.status)["ModelInspected"] == ("False", "Inspecting")
    assert outcome.status["phase"] == "Pending" and outcome.retry_after_seconds is not None
    (job,) = cluster.of_kind("Job").values()
    pod_spec = job["spec"]["template"]["spec"]
    assert "$MF_MODEL_URI" in pod_spec["containers"][0]["command"][-1]
    assert [v["name"] for v in pod_spec["volumes"]] == ["scratch"]
    assert [
        o for o in cluster.of_kind("Pod").values() if o["metadata"]["labels"].get("modelfleet.io/component") == "stage"
    ] == []


def inspection_pod(cluster: FakeCluster, phase: str, message: str) -> None:
    job = next(iter(cluster.of_kind("Job").values()))
    labels = job["spec"]["template"]["metadata"]["labels"]
    terminated = {"state": {"terminated": {"exitCode": 0 if phase == "Succeeded" else 1, "message": message}}}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "inspect-1", "namespace": "ai", "labels": labels}}
    pod["status"] = {"phase": phase, "containerStatuses": [terminated]}
    cluster.objects["Pod", "ai", "inspect-1"] = pod


def test_a_local_model_is_inspected_by_a_job_whose_report_becomes_the_summary():
    body = fleet(parallelism={"pipeline": 2})
    cluster = FakeCluster([node("a"), node("b")])
    outcome = reconcile(body, cluster)
    assert conditions(outcome.status)["ModelInspected"][1] == "Inspecting"
    [job] = cluster.of_kind("Job").values()
    assert job["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == "models"
    assert cluster.of_kind("Pod") == {}
    inspection_pod(cluster, "Succeeded", summary(8).model_dump_json())
    outcome = reconcile(body, cluster)
    assert conditions(outcome.status)["ModelInspected"] == ("True", "SummaryFound")
    assert "qwen-model-summary" in cluster.of_kind("ConfigMap")
    assert [m["layerEnd"] for m in outcome.status["members"]] == [4, 8]


def test_a_failed_inspection_is_reported_with_its_message():
    body = fleet()
    cluster = FakeCluster([node("a")])
    reconcile(body, cluster)
    inspection_pod(cluster, "Failed", "no config.json in /models/qwen3")
    outcome = reconcile(body, cluster)
    assert conditions(outcome.status)["ModelInspected"] == ("False", "InspectionFailed")
    assert "no config.json in /models/qwen3" in outcome.status["conditions"][0]["message"]


def test_a_summary_of_another_model_is_not_used():
    body = fleet()
    stale = summary_config_map("qwen", "ai", summary(8))
    stale["metadata"]["labels"] = {"modelfleet.io/model": "another"}
    cluster = FakeCluster([node("a")], [stale])
    outcome = reconcile(body, cluster)
    assert conditions(outcome.status)["ModelInspected"][1] == "Inspecting"


def test_a_fleet_is_planned_applied_and_reported_with_members():
    body = fleet(parallelism={"pipeline": 2})
    cluster = cluster_for(body)
    outcome = reconcile(body, cluster)
    assert outcome.permanent_error is None and outcome.retry_after_seconds is None
    assert cluster.pods() == ["qwen-g0-s0", "qwen-g0-s1"]
    assert set(cluster.of_kind("Service")) == {"qwen-stages", "qwen-gateway"}
    keys = cluster.of_kind("Secret")["qwen-transport"]["data"]
    assert len(base64.b64decode(keys["fleet.key"])) == len(base64.b64decode(keys["fleet.key_secret"])) == 40
    plan_map = cluster.of_kind("ConfigMap")["qwen-plan"]
    status = outcome.status
    assert status["planHash"] == plan_map["metadata"]["annotations"]["modelfleet.io/plan-hash"]
    assert conditions(status)["Planned"] == ("True", "Planned")
    assert conditions(status)["Ready"] == ("False", "FleetNotReady")
    assert (status["phase"], status["observedGeneration"], status["stages"], status["ready"]) == (
        "Loading",
        1,
        2,
        "0/2",
    )
    assert status["members"][1] == {
        "group": 0, "stage": 1, "tpRank": 0, "pod": cluster.pod_name("qwen-g0-s1"), "node": "b", "layerStart": 4, "layerEnd": 8,
        "phase": "Pending", "layersLoaded": 0, "layersTotal": 4,
    }  # fmt: skip
    assert status["endpoint"] == "http://qwen-gateway.ai.svc:8000/v1"


def test_a_second_pass_changes_nothing():
    body = fleet(parallelism={"pipeline": 2})
    cluster = cluster_for(body)
    first = reconcile(body, cluster)
    cluster.log.clear()
    second = reconcile(with_status(body, first.status), cluster)
    assert cluster.log == []
    assert second.status["planHash"] == first.status["planHash"]


def test_ready_pods_and_gateway_make_the_fleet_ready():
    body = fleet(parallelism={"pipeline": 2})
    cluster = cluster_for(body)
    reconcile(body, cluster)
    for pod in ("qwen-g0-s0", "qwen-g0-s1"):
        cluster.set_pod(pod, "Running", ready=True)
    cluster.of_kind("Deployment")["qwen-gateway"]["status"] = {"readyReplicas": 1}
    status = reconcile(body, cluster).status
    assert status["phase"] == "Ready" and status["ready"] == "2/2" and status["replicas"] == 1
    assert {k: v[0] for k, v in conditions(status).items()} == dict.fromkeys(
        ["ModelInspected", "Planned", "Scheduled", "WeightsLoaded", "ChainReady", "GatewayReady", "Ready"], "True"
    )
    assert [m["layersLoaded"] for m in status["members"]] == [4, 4]


def test_members_report_the_agents_own_phase_and_loading_progress():
    body = fleet(parallelism={"pipeline": 2})
    cluster = cluster_for(body)
    reconcile(body, cluster)
    cluster.set_pod("qwen-g0-s0", "Running")
    cluster.set_pod("qwen-g0-s1", "Running", ready=True)
    cluster.agents[cluster.pod_name("qwen-g0-s0")] = {"phase": "Loading", "layers_loaded": 3, "layers_total": 4}
    cluster.agents[cluster.pod_name("qwen-g0-s1")] = {"phase": "Draining", "layers_loaded": 4, "layers_total": 4}
    members = reconcile(body, cluster).status["members"]
    assert [(m["phase"], m["layersLoaded"], m["layersTotal"]) for m in members] == [
        ("Loading", 3, 4),
        ("Draining", 4, 4),
    ]


def test_one_ready_group_of_two_is_degraded():
    body = fleet(parallelism={"pipeline": 1}, replicas=2)
    cluster = cluster_for(body)
    reconcile(body, cluster)
    cluster.set_pod("qwen-g0-s0", "Running", ready=True)
    status = reconcile(body, cluster).status
    assert status["phase"] == "Degraded" and conditions(status)["ChainReady"] == ("False", "SomeGroupsReady")


def test_a_failed_stage_pod_is_replaced_alone_and_counted():
    body = fleet(parallelism={"pipeline": 2})
    cluster = cluster_for(body)
    status = reconcile(body, cluster).status
    cluster.set_pod("qwen-g0-s0", "Running", ready=True)
    cluster.set_pod("qwen-g0-s1", "Failed")
    cluster.log.clear()
    outcome = reconcile(with_status(body, status), cluster)
    status = outcome.status
    assert cluster.unrevised_log() == ["delete Pod/qwen-g0-s1", "create Pod/qwen-g0-s1"]
    assert outcome.replaced == [cluster.pod_name("qwen-g0-s1")]
    assert status["stageRestarts"] == {cluster.pod_name("qwen-g0-s1"): 1}
    assert "status" in cluster.of_kind("Pod")[cluster.pod_name("qwen-g0-s0")]  # the healthy stage was left alone


def test_a_stage_failing_past_max_stage_restarts_fails_the_fleet_for_good():
    body = fleet(parallelism={"pipeline": 2}, restartPolicy={"maxStageRestarts": 1})
    cluster = cluster_for(body)
    status = reconcile(body, cluster).status
    for _ in range(2):
        cluster.set_pod("qwen-g0-s1", "Failed")
        status = reconcile(with_status(body, status), cluster).status
    assert status["phase"] == "Failed"
    assert conditions(status)["Ready"] == ("False", "StageCrashLooping")
    assert "failed after 1 replacements" in next(c["message"] for c in status["conditions"] if c["type"] == "Ready")
    cluster.log.clear()
    again = reconcile(with_status(body, status), cluster)
    assert cluster.log == [] and again.status == status
    # a new generation (the user changed the spec) counts afresh: this replacement is its first
    fixed = reconcile(with_status(fleet(generation=2, parallelism={"pipeline": 2}), status), cluster).status
    assert fixed["phase"] != "Failed" and list(map(unrevised, fixed["stageRestarts"])) == ["qwen-g0-s1"]


def test_an_invalid_spec_is_a_permanent_error_with_a_failed_condition():
    body = fleet(serving={"contextLength": 4, "windowRows": 8})
    outcome = reconcile(body, cluster_for(body))
    assert outcome.permanent_error is not None and "serving.windowRows=8" in outcome.permanent_error
    assert outcome.status["phase"] == "Failed"
    assert conditions(outcome.status)["Ready"] == ("False", "InvalidSpec")


@pytest.mark.parametrize(
    "spec, nodes, reason",
    [
        ({"accelerator": {"profile": "nvidia-gpu"}}, [node("a")], "NoMatchingNodes"),
        ({"parallelism": {"pipeline": 3}}, [node("a"), node("b")], "InsufficientCapacity"),
        ({}, [node("a", "4Gi")], "InsufficientCapacity"),
    ],
)
def test_an_infeasible_fleet_is_not_planned_and_retried(spec, nodes, reason):
    body = fleet(**spec)
    cluster = cluster_for(body, nodes)
    outcome = reconcile(body, cluster)
    assert conditions(outcome.status)["Planned"] == ("False", reason)
    assert outcome.status["phase"] == "Pending" and outcome.retry_after_seconds is not None
    assert cluster.of_kind("Pod") == {}


def test_a_node_joining_keeps_the_plan_and_a_new_generation_replans():
    body = fleet()
    cluster = cluster_for(body, [node("a"), node("b")])
    first = reconcile(body, cluster).status
    cluster.nodes.append(node("c"))
    assert reconcile(body, cluster).status["planHash"] == first["planHash"]
    cluster.log.clear()
    replanned = reconcile(fleet(generation=2), cluster).status
    new = replanned["updateRevision"]
    assert new != first["revision"] == replanned["revision"]  # the old revision serves until the new one is ready
    assert [f"create Pod/qwen-{new}-g0-s{k}" in cluster.log for k in range(3)] == [True] * 3
    plan_map = cluster.of_kind("ConfigMap")["qwen-plan"]
    assert plan_map["metadata"]["annotations"]["modelfleet.io/revision"] == new


def test_scaling_down_deletes_the_pods_the_plan_no_longer_has():
    body = fleet(parallelism={"pipeline": 1}, replicas=2)
    cluster = cluster_for(body, [node("a"), node("b")])
    old = serving(cluster, body)["revision"]
    assert cluster.pods() == ["qwen-g0-s0", "qwen-g1-s0"]
    scaled = fleet(generation=2, parallelism={"pipeline": 1}, replicas=1)
    new = reconcile(scaled, cluster).status["revision"]  # an 8 GiB stage has no room beside another: replaced
    assert old != new and cluster.revisions() == {new} and cluster.pods() == ["qwen-g0-s0"]
    status = reconcile(scaled, cluster).status
    assert [m["pod"] for m in status["members"]] == [cluster.pod_name("qwen-g0-s0")]


# ---- rollouts ---------------------------------------------------------------------------------


def serving(cluster: FakeCluster, body: dict[str, Any]) -> dict[str, Any]:
    """Reconcile ``body`` until it serves: its pods ready, the gateway rolled out and ready."""
    status = reconcile(body, cluster).status
    for name in cluster.of_kind("Pod"):
        cluster.set_pod(unrevised(name), "Running", ready=True, revision=status["revision"])
    cluster.settle_gateway()
    status = reconcile(with_status(body, status), cluster).status
    assert status["phase"] == "Ready"
    return status


def surge_beside_serving(spec: dict[str, Any]) -> tuple[FakeCluster, dict[str, Any], dict[str, Any]]:
    """A fleet of ``spec`` serving, then a plan change whose new revision surges beside it:
    (cluster, the changed body, its status after the first pass)."""
    cluster = cluster_for(fleet(**spec))
    serving(cluster, fleet(**spec))
    changed = fleet(generation=2, serving={"maxStreams": 8}, **spec)
    return cluster, changed, reconcile(changed, cluster).status


def gateway_revision(cluster: FakeCluster) -> str:
    gateway = cluster.of_kind("Deployment")["qwen-gateway"]
    volumes = {v["name"]: v for v in gateway["spec"]["template"]["spec"]["volumes"]}
    revision = gateway["spec"]["template"]["metadata"]["annotations"]["modelfleet.io/revision"]
    assert volumes["plan"]["configMap"]["name"] == f"qwen-plan-{revision}"  # the plan the gateway reads
    return str(revision)


def progressing(status: dict[str, Any]) -> tuple[str, str, str]:
    found = next(c for c in status["conditions"] if c["type"] == "Progressing")
    return found["status"], found["reason"], found["message"]


PIPELINE_2 = {"parallelism": {"pipeline": 2}}


def test_a_plan_change_starts_the_new_revision_beside_the_old_one_which_keeps_serving():
    cluster = cluster_for(fleet(**PIPELINE_2))
    old = serving(cluster, fleet(**PIPELINE_2))["revision"]
    cluster.log.clear()
    changed = fleet(generation=2, serving={"maxStreams": 8}, **PIPELINE_2)
    outcome = reconcile(changed, cluster)
    new = outcome.status["updateRevision"]
    assert new != old and cluster.revisions() == {old, new}
    assert not [line for line in cluster.log if line.startswith("delete")]
    assert f"create ConfigMap/qwen-plan-{new}" in cluster.log
    assert gateway_revision(cluster) == old
    for pod in cluster.of_kind("Pod").values():  # each revision's pods read their own plan
        revision = pod["metadata"]["labels"]["modelfleet.io/revision"]
        plan_volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "plan")
        assert plan_volume["configMap"]["name"] == f"qwen-plan-{revision}"
    status = outcome.status
    assert (status["phase"], status["revision"], conditions(status)["Ready"]) == ("Ready", old, ("True", "FleetReady"))
    assert progressing(status) == (
        "True",
        "RollingOut",
        f"revision {new}: 0/2 members ready beside revision {old}, which serves",
    )
    assert outcome.retry_after_seconds is not None  # readiness wakes no handler: the pass comes back soon


def test_the_old_revision_keeps_the_gateway_while_the_new_one_loads():
    cluster = cluster_for(fleet(**PIPELINE_2))
    old = serving(cluster, fleet(**PIPELINE_2))["revision"]
    changed = fleet(generation=2, serving={"maxStreams": 8}, **PIPELINE_2)
    status = reconcile(changed, cluster).status
    new = status["updateRevision"]
    cluster.set_pod("qwen-g0-s0", "Running", ready=True, revision=new)
    cluster.set_pod("qwen-g0-s1", "Running", revision=new)
    cluster.log.clear()
    status = reconcile(with_status(changed, status), cluster).status
    assert cluster.log == [] and gateway_revision(cluster) == old and cluster.revisions() == {old, new}
    assert status["phase"] == "Ready" and [m["pod"] for m in status["members"]] == [
        cluster.pod_name("qwen-g0-s0", old), cluster.pod_name("qwen-g0-s1", old)
    ]  # fmt: skip
    assert progressing(status)[2] == f"revision {new}: 1/2 members ready beside revision {old}, which serves"


def test_a_ready_new_revision_takes_the_gateway_and_the_old_pods_go_once_the_gateway_has_rolled():
    cluster = cluster_for(fleet(**PIPELINE_2))
    old = serving(cluster, fleet(**PIPELINE_2))["revision"]
    changed = fleet(generation=2, serving={"maxStreams": 8}, **PIPELINE_2)
    status = reconcile(changed, cluster).status
    new = status["updateRevision"]
    for pod in ("qwen-g0-s0", "qwen-g0-s1"):
        cluster.set_pod(pod, "Running", ready=True, revision=new)
    cluster.log.clear()
    status = reconcile(with_status(changed, status), cluster).status
    assert cluster.log == ["patch Deployment/qwen-gateway"] and gateway_revision(cluster) == new
    assert status["revision"] == new and status["updateRevision"] is None
    # the Deployment rolls its pods; until every one runs the new template, the old chain stays
    status = reconcile(with_status(changed, status), cluster).status
    assert cluster.revisions() == {old, new}
    assert progressing(status) == (
        "True", "RollingOut",
        f"the gateway moves to revision {new}; the pods of revision {old} go once every gateway pod runs it",
    )  # fmt: skip
    cluster.settle_gateway()
    cluster.log.clear()
    status = reconcile(with_status(changed, status), cluster).status
    assert cluster.revisions() == {new} and f"qwen-plan-{old}" not in cluster.of_kind("ConfigMap")
    assert sorted(cluster.unrevised_log()) == [
        f"delete ConfigMap/qwen-plan-{old}", "delete Pod/qwen-g0-s0", "delete Pod/qwen-g0-s1"
    ]  # fmt: skip
    assert progressing(status) == ("True", "RolloutComplete", f"revision {new} serves") and status["phase"] == "Ready"
    plan = json.loads(cluster.of_kind("ConfigMap")[f"qwen-plan-{new}"]["data"]["plan.json"])
    assert plan["serving"]["max_streams"] == 8
    cluster.log.clear()
    assert reconcile(with_status(changed, status), cluster).retry_after_seconds is None and cluster.log == []


def test_a_new_revision_failing_past_max_stage_restarts_stops_the_rollout_and_the_old_one_keeps_serving():
    cluster, changed, status = surge_beside_serving({**PIPELINE_2, "restartPolicy": {"maxStageRestarts": 1}})
    old, new = status["revision"], status["updateRevision"]
    for _ in range(2):
        cluster.set_pod("qwen-g0-s1", "Failed", revision=new)
        status = reconcile(with_status(changed, status), cluster).status
    assert cluster.revisions() == {old} and gateway_revision(cluster) == old
    assert (status["phase"], status["revision"]) == ("Ready", old)
    state, reason, message = progressing(status)
    assert (state, reason) == ("False", "RolloutFailed") and f"revision {new} failed" in message
    assert "after 1 replacements" in message and f"revision {old} keeps serving" in message
    cluster.log.clear()
    again = reconcile(with_status(changed, status), cluster)
    assert cluster.log == [] and progressing(again.status) == progressing(status)  # stopped until the next generation


T0 = dt.datetime(2026, 11, 29, 16, 0, tzinfo=dt.UTC)


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def unschedulable(cluster: FakeCluster, name: str, revision: str) -> None:
    """What the scheduler reports of a pod that fits no node."""
    pod = cluster.of_kind("Pod")[cluster.pod_name(name, revision)]
    scheduled = {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": "0/2 nodes are available",
    }
    pod["status"] = {"phase": "Pending", "conditions": [scheduled]}


def test_a_new_revision_not_ready_within_the_progress_deadline_is_abandoned_and_the_old_one_keeps_serving():
    cluster = cluster_for(fleet(**PIPELINE_2))
    old = serving(cluster, fleet(**PIPELINE_2))["revision"]
    changed = fleet(generation=2, serving={"maxStreams": 8}, rollout={"progressDeadlineSeconds": 600}, **PIPELINE_2)
    status = reconcile(changed, cluster, now=at(0)).status
    new = status["updateRevision"]
    assert status["rolloutStartedAt"] == "2026-11-29T16:00:00Z"
    cluster.set_pod("qwen-g0-s0", "Running", ready=True, revision=new)
    unschedulable(cluster, "qwen-g0-s1", new)
    status = reconcile(with_status(changed, status), cluster, now=at(600)).status  # at the deadline: in time
    assert progressing(status)[1] == "RollingOut" and status["rolloutStartedAt"] == "2026-11-29T16:00:00Z"
    assert cluster.revisions() == {old, new}
    outcome = reconcile(with_status(changed, status), cluster, now=at(601))
    status = outcome.status
    assert progressing(status) == (
        "False", "ProgressDeadlineExceeded",
        f"revision {new} was not ready 601 s after its rollout began at 2026-11-29T16:00:00Z"
        " (rollout.progressDeadlineSeconds=600); not ready:"
        f" qwen-{new}-g0-s1 (Pending: Unschedulable 0/2 nodes are available);"
        f" revision {old} keeps serving",
    )  # fmt: skip
    assert cluster.revisions() == {old} and f"qwen-plan-{new}" not in cluster.of_kind("ConfigMap")
    assert gateway_revision(cluster) == old and (status["phase"], status["revision"]) == ("Ready", old)
    assert status["rolloutStartedAt"] is None and outcome.retry_after_seconds is None
    cluster.log.clear()
    again = reconcile(with_status(changed, status), cluster, now=at(700))
    assert cluster.log == [] and progressing(again.status) == progressing(status)  # stopped until the next generation
    longer = fleet(generation=3, serving={"maxStreams": 8}, rollout={"progressDeadlineSeconds": 1200}, **PIPELINE_2)
    status = reconcile(with_status(longer, again.status), cluster, now=at(800)).status
    assert status["updateRevision"] == new and cluster.revisions() == {old, new}  # tried again, on a fresh clock
    assert progressing(status)[1] == "RollingOut" and status["rolloutStartedAt"] == "2026-11-29T16:13:20Z"


def test_the_progress_deadline_counts_from_the_status_so_a_restarted_operator_keeps_it():
    cluster = cluster_for(fleet(**PIPELINE_2))
    serving(cluster, fleet(**PIPELINE_2))
    changed = fleet(generation=2, serving={"maxStreams": 8}, **PIPELINE_2)  # the default deadline: 900 s
    status = reconcile(changed, cluster, now=at(0)).status
    # a restarted operator has nothing but the fleet's status: the same passes, from the status alone
    status = reconcile(with_status(changed, status), cluster, now=at(500)).status
    assert status["rolloutStartedAt"] == "2026-11-29T16:00:00Z" and progressing(status)[1] == "RollingOut"
    lost = {k: v for k, v in status.items() if k != "rolloutStartedAt"}  # without the record, the clock starts again
    restarted = reconcile(with_status(changed, lost), cluster, now=at(901)).status
    assert progressing(restarted)[1] == "RollingOut" and restarted["rolloutStartedAt"] == "2026-11-29T16:15:01Z"
    late = reconcile(with_status(changed, status), cluster, now=at(901)).status
    assert progressing(late)[:2] == ("False", "ProgressDeadlineExceeded") and "901 s" in progressing(late)[2]
    assert "(Pending)" in progressing(late)[2]  # a pod that reports nothing: its phase alone


def test_a_serving_stage_out_of_restarts_during_a_rollout_degrades_the_fleet_and_the_rollout_goes_on():
    cluster, changed, status = surge_beside_serving({**PIPELINE_2, "restartPolicy": {"maxStageRestarts": 1}})
    old, new = status["revision"], status["updateRevision"]
    for _ in range(2):
        cluster.set_pod("qwen-g0-s1", "Failed", revision=old)
        outcome = reconcile(with_status(changed, status), cluster)
        status = outcome.status
    broken = cluster.pod_name("qwen-g0-s1", old)
    assert status["phase"] == "Degraded" and status["revision"] == old and status["updateRevision"] == new
    assert conditions(status)["Ready"] == ("False", "ServingStageCrashLooping")
    ready_message = next(c["message"] for c in status["conditions"] if c["type"] == "Ready")
    assert ready_message == (
        f"revision {old}: stage pod {broken} failed after 1 replacements (restartPolicy.maxStageRestarts=1);"
        f" the rollout to revision {new} goes on and replaces it"
    )
    assert progressing(status)[:2] == ("True", "RollingOut") and outcome.retry_after_seconds is not None
    assert cluster.revisions() == {old, new} and cluster.of_kind("Pod")[broken]["status"]["phase"] == "Failed"
    for pod in ("qwen-g0-s0", "qwen-g0-s1"):
        cluster.set_pod(pod, "Running", ready=True, revision=new)
    status = reconcile(with_status(changed, status), cluster).status
    assert gateway_revision(cluster) == new and status["phase"] == "Ready"
    cluster.settle_gateway()
    status = reconcile(with_status(changed, status), cluster).status
    assert cluster.revisions() == {new} and broken not in cluster.of_kind("Pod")
    assert progressing(status) == ("True", "RolloutComplete", f"revision {new} serves")
    assert conditions(status)["Ready"] == ("True", "FleetReady")


def test_a_serving_pod_recreated_during_a_rollout_is_made_from_the_serving_revisions_spec():
    before = {**PIPELINE_2, "images": {"agent": "registry/agent:1"}}
    cluster = cluster_for(fleet(**before))
    old = serving(cluster, fleet(**before))["revision"]
    after = {**PIPELINE_2, "images": {"agent": "registry/agent:2"}, "resources": {"cpu": "2", "memory": "1Gi"}}
    changed = fleet(generation=2, serving={"maxStreams": 8}, **after)
    status = reconcile(changed, cluster).status
    new = status["updateRevision"]
    gone = cluster.pod_name("qwen-g0-s0", old)
    cluster.delete("v1", "Pod", "ai", gone)  # evicted, say
    cluster.log.clear()
    reconcile(with_status(changed, status), cluster)
    assert f"create Pod/{gone}" in cluster.log
    pods = cluster.of_kind("Pod")

    def agent(name: str) -> dict[str, Any]:
        return pods[name]["spec"]["containers"][0]

    # the serving revision's spec set no resources: its defaults (one core, the planned bytes)
    assert agent(gone)["image"] == "registry/agent:1" and agent(gone)["resources"]["requests"]["cpu"] == "1"
    fresh = agent(cluster.pod_name("qwen-g0-s0", new))
    assert fresh["image"] == "registry/agent:2" and fresh["resources"]["requests"] == {"cpu": "2", "memory": "1Gi"}
    recorded = json.loads(cluster.of_kind("ConfigMap")[f"qwen-plan-{old}"]["data"]["spec.json"])
    assert recorded["images"]["agent"] == "registry/agent:1" and "memory" not in recorded["resources"]


def test_a_new_plan_that_does_not_fit_keeps_the_old_revision_serving():
    cluster = cluster_for(fleet(**PIPELINE_2))
    old = serving(cluster, fleet(**PIPELINE_2))["revision"]
    cluster.log.clear()
    outcome = reconcile(fleet(generation=2, parallelism={"pipeline": 3}), cluster)
    status = outcome.status
    assert conditions(status)["Planned"] == ("False", "InsufficientCapacity")
    assert (
        progressing(status)[:2] == ("False", "RolloutFailed")
        and f"revision {old} keeps serving" in progressing(status)[2]
    )
    assert (status["phase"], status["revision"], cluster.revisions()) == ("Ready", old, {old})
    assert cluster.log == [] and outcome.retry_after_seconds is not None


def test_without_room_beside_the_old_members_the_new_revision_surges_onto_spare_nodes():
    nodes = [node("a", "10Gi"), node("b", "10Gi"), node("c", "10Gi"), node("d", "10Gi")]
    cluster = cluster_for(fleet(**PIPELINE_2), nodes)
    old = serving(cluster, fleet(**PIPELINE_2))["revision"]
    status = reconcile(fleet(generation=2, serving={"maxStreams": 8}, **PIPELINE_2), cluster).status
    assert cluster.revisions() == {old, status["updateRevision"]} and gateway_revision(cluster) == old
    new_nodes = {m["node"] for m in json.loads(cluster.of_kind("ConfigMap")["qwen-plan"]["data"]["members.json"])}
    assert {m["node"] for m in status["members"]} == {"a", "b"} and new_nodes == {"c", "d"}
    assert progressing(status)[1] == "RollingOut"


SPREAD = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
    {"labelSelector": {"matchLabels": {"modelfleet.io/fleet": "qwen"}}, "topologyKey": "kubernetes.io/hostname"}
]}}  # fmt: skip


@pytest.mark.parametrize(
    "nodes, reason, new_nodes",
    [
        (["a", "b", "c", "d"], "RollingOut", {"c", "d"}),  # room on nodes the old members leave alone
        (["a", "b"], "RolloutWithoutSurge", {"a", "b"}),  # none: replaced
    ],
)
def test_pod_anti_affinity_keeps_a_new_revision_off_the_nodes_of_the_old_one(nodes, reason, new_nodes):
    body = fleet(placement={"affinity": SPREAD}, **PIPELINE_2)
    cluster = cluster_for(body, [node(n) for n in nodes])  # 18 GiB: memory alone would fit both
    serving(cluster, body)
    status = reconcile(
        fleet(generation=2, serving={"maxStreams": 8}, placement={"affinity": SPREAD}, **PIPELINE_2), cluster
    ).status
    members = json.loads(cluster.of_kind("ConfigMap")["qwen-plan"]["data"]["members.json"])
    assert {m["node"] for m in members} == new_nodes and progressing(status)[1] == reason
    if reason == "RolloutWithoutSurge":
        assert "placement.affinity.podAntiAffinity required term 0 keeps revision" in progressing(status)[2]


def test_the_planned_condition_names_the_affinity_the_planner_leaves_to_the_scheduler():
    zone = {
        "labelSelector": {"matchLabels": {"modelfleet.io/fleet": "qwen"}},
        "topologyKey": "topology.kubernetes.io/zone",
    }
    body = fleet(
        placement={"affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [zone]}}}
    )
    status = reconcile(body, cluster_for(body)).status
    planned = next(c["message"] for c in status["conditions"] if c["type"] == "Planned")
    assert planned == (
        "2 members on a, b; placement.affinity.podAntiAffinity required term 0 (topologyKey topology.kubernetes.io/zone)"
        " is left to the scheduler: the planner evaluates kubernetes.io/hostname only"
    )


def test_without_room_for_both_revisions_the_new_one_replaces_the_old():
    small = [node("a", "10Gi"), node("b", "10Gi")]  # a 4 GiB stage fits a node, two do not
    cluster = cluster_for(fleet(**PIPELINE_2), small)
    old = serving(cluster, fleet(**PIPELINE_2))["revision"]
    cluster.log.clear()
    status = reconcile(fleet(generation=2, serving={"maxStreams": 8}, **PIPELINE_2), cluster).status
    new = status["revision"]
    assert new != old and cluster.revisions() == {new} and gateway_revision(cluster) == new
    assert cluster.unrevised_log().index("delete Pod/qwen-g0-s0") > cluster.unrevised_log().index(
        "create Pod/qwen-g0-s0"
    )
    state, reason, message = progressing(status)
    assert (state, reason) == ("True", "RolloutWithoutSurge")
    assert f"revision {new} replaces revision {old} without a surge" in message
    assert f"no room beside revision {old}'s members" in message and "short by" in message
    changed = fleet(generation=2, serving={"maxStreams": 8}, **PIPELINE_2)
    status = reconcile(with_status(changed, status), cluster).status
    assert progressing(status)[1] == "RolloutWithoutSurge"  # until the new revision serves
    for pod in ("qwen-g0-s0", "qwen-g0-s1"):
        cluster.set_pod(pod, "Running", ready=True)
    cluster.settle_gateway()
    status = reconcile(with_status(changed, status), cluster).status
    assert progressing(status) == ("True", "RolloutComplete", f"revision {new} serves")


def test_a_planned_node_that_disappears_triggers_a_new_plan():
    body = fleet()
    cluster = cluster_for(body, [node("a"), node("b"), node("c")])
    first = reconcile(body, cluster).status
    cluster.nodes.pop()
    status = reconcile(body, cluster).status
    members = json.loads(cluster.of_kind("ConfigMap")["qwen-plan"]["data"]["members.json"])
    assert members[-1]["node"] == "b" != first["members"][-1]["node"] and status["updateRevision"] != first["revision"]


# ---- the kopf handler -------------------------------------------------------------------------


@pytest.fixture
def use():
    yield handlers.use_cluster
    handlers.use_cluster(None)


def test_the_handler_writes_status_and_raises_kopf_errors(use):
    import logging

    body = fleet(parallelism={"pipeline": 2})
    use(cluster_for(body))
    patch = kopf.Patch()
    handlers.reconcile_fleet(body=body, patch=patch, logger=logging.getLogger("test"))
    assert patch["status"]["phase"] == "Loading"

    bad = fleet(serving={"contextLength": 4, "windowRows": 8})
    patch = kopf.Patch()
    with pytest.raises(kopf.PermanentError, match="windowRows"):
        handlers.reconcile_fleet(body=bad, patch=patch, logger=logging.getLogger("test"))
    assert patch["status"]["phase"] == "Failed"

    from modelfleet.operator.metrics import REGISTRY

    labels = {"namespace": "ai", "fleet": "qwen"}
    assert REGISTRY.get_sample_value("modelfleet_operator_reconciles_total", {**labels, "result": "invalid"}) >= 1
    assert REGISTRY.get_sample_value("modelfleet_operator_members", labels) is not None

    use(FakeCluster([node("a")]))
    with pytest.raises(kopf.TemporaryError) as raised:
        handlers.reconcile_fleet(body=fleet(), patch=kopf.Patch(), logger=logging.getLogger("test"))
    assert raised.value.delay == 15.0


def test_the_operator_reads_an_agents_status_over_http_and_tolerates_silence():
    import http.server
    import json
    import threading

    from modelfleet.operator.kube import read_agent_status

    class Status(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"phase": "Loading", "layers_loaded": 2}).encode()
            self.send_response(200 if self.path == "/status" else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Status)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        pod = {"status": {"podIP": "127.0.0.1"}}
        assert read_agent_status(pod, server.server_address[1]) == {"phase": "Loading", "layers_loaded": 2}
    finally:
        server.shutdown()
        server.server_close()
    assert read_agent_status(pod, server.server_address[1]) is None  # nobody listens now
    assert read_agent_status({"status": {}}) is None  # not scheduled yet


def test_a_spec_change_that_keeps_the_plan_keeps_the_revision_and_its_pods():
    cluster = cluster_for(fleet(parallelism={"pipeline": 2}))
    first = reconcile(fleet(parallelism={"pipeline": 2}), cluster).status
    cluster.log.clear()
    more_gateways = fleet(generation=2, parallelism={"pipeline": 2}, gateway={"replicas": 2})
    second = reconcile(more_gateways, cluster).status
    assert second["revision"] == first["revision"]
    assert cluster.log == [
        "patch ConfigMap/qwen-plan",
        f"patch ConfigMap/qwen-plan-{first['revision']}",
        "patch Deployment/qwen-gateway",
    ]  # no pod touched; the revision's record of its spec follows the spec


@pytest.mark.parametrize(
    "change", [{"images": {"agent": "registry/agent:2"}}, {"resources": {"cpu": "2", "memory": "1Gi"}}]
)
def test_an_image_or_resources_change_alone_rolls_out_a_new_revision_beside_the_serving_one(change):
    before = {**PIPELINE_2, "images": {"agent": "registry/agent:1"}}
    cluster = cluster_for(fleet(**before))
    old = serving(cluster, fleet(**before))["revision"]
    status = reconcile(fleet(generation=2, **{**before, **change}), cluster).status
    new = status["updateRevision"]
    assert new != old and status["revision"] == old  # the old revision serves while the new one loads
    assert progressing(status)[1] == "RollingOut" and cluster.revisions() == {old, new}


def test_a_fleet_name_too_long_for_its_pod_names_is_a_permanent_error():
    body = fleet(name="q" * 41)
    outcome = reconcile(body, cluster_for(body))
    assert outcome.permanent_error is not None and "at most 40" in outcome.permanent_error
    assert conditions(outcome.status)["Ready"] == ("False", "InvalidSpec")
    ok = fleet(name="q" * 40, parallelism={"pipeline": 2})
    assert all(len(m["pod"]) <= 63 for m in reconcile(ok, cluster_for(ok)).status["members"])
