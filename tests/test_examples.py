"""Every example fleet (examples/*.yaml) is admitted by the CRD as the API server would admit it,
and ``modelfleet render`` plans it on its Node objects (examples/nodes/) and model summary
(examples/summaries/) into objects that pass kubernetes-validate's strict schemas."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from test_operator_crd import admit
from typer.testing import CliRunner

from modelfleet.commands.render import app
from modelfleet.operator.spec import parse_spec

EXAMPLES = Path(__file__).parents[1] / "examples"
NAMES = sorted(p.stem for p in EXAMPLES.glob("*.yaml"))


def fleet(name: str) -> dict[str, Any]:
    (doc,) = [d for d in yaml.safe_load_all((EXAMPLES / f"{name}.yaml").read_text()) if d]
    return dict(doc)


def render(name: str) -> list[dict[str, Any]]:
    args = ["render", "--fleet", str(EXAMPLES / f"{name}.yaml"), "--nodes", str(EXAMPLES / "nodes" / f"{name}.yaml")]
    result = CliRunner().invoke(app, [*args, "--model-summary", str(EXAMPLES / "summaries" / f"{name}.json")])
    assert result.exit_code == 0, result.output
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def stages(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    (plan_map,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-plan")]
    return list(json.loads(plan_map["data"]["plan.json"])["groups"][0]["stages"])


def test_the_four_examples_each_have_nodes_a_summary_and_a_readme_paragraph() -> None:
    assert NAMES == ["cascadia-11-aipc", "freetoken-4gpu", "local-cpu", "mixed-fleet"]
    readme = (EXAMPLES / "README.md").read_text()
    for name in NAMES:
        assert (EXAMPLES / "nodes" / f"{name}.yaml").is_file() and (EXAMPLES / "summaries" / f"{name}.json").is_file()
        assert f"{name}.yaml" in readme


@pytest.mark.parametrize("name", NAMES)
def test_example_is_admitted_by_the_crd_and_parses_as_a_spec(name: str) -> None:
    body = fleet(name)
    assert (body["apiVersion"], body["kind"]) == ("modelfleet.io/v1alpha1", "ModelFleet")
    _, errors = admit(body["spec"])
    assert errors == []
    parse_spec(body["spec"])


@pytest.mark.parametrize("name", NAMES)
def test_example_renders_objects_that_pass_kubernetes_validate_strict(name: str) -> None:
    for obj in render(name):
        kubernetes_validate.validate(obj, "1.31.0", strict=True)


def test_cascadia_is_eleven_stages_of_six_layers_on_the_igpus_with_openvino() -> None:
    objects = render("cascadia-11-aipc")
    assert [(s["layer_start"], s["layer_end"]) for s in stages(objects)] == [(6 * k, 6 * k + 6) for k in range(11)]
    pods = [o for o in objects if o["kind"] == "Pod"]
    assert len(pods) == 11
    assert all(p["spec"]["containers"][0]["resources"]["limits"]["gpu.intel.com/xe"] == "1" for p in pods)
    spec = parse_spec(fleet("cascadia-11-aipc")["spec"])
    assert (spec.backend, spec.model.formats.experts, spec.model.formats.attention) == ("openvino", "int4", "int8")


def test_freetoken_is_one_stage_of_four_tensor_ranks_on_the_four_gpus_of_its_node_with_mxfp4_experts() -> None:
    objects = render("freetoken-4gpu")
    pods = [o for o in objects if o["kind"] == "Pod"]
    (stage,) = stages(objects)
    assert (stage["layer_start"], stage["layer_end"], stage["tp_size"]) == (0, 43, 4)
    assert sorted(int(p["metadata"]["labels"]["modelfleet.io/tp-rank"]) for p in pods) == [0, 1, 2, 3]
    for pod in pods:
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        assert (limits["nvidia.com/gpu"], limits["cpu"], limits["memory"]) == ("1", "7", "60Gi")
        (term,) = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"
        ]
        assert term["matchFields"][0]["values"] == ["gpu-box"]
    assert parse_spec(fleet("freetoken-4gpu")["spec"]).model.formats.experts == "mxfp4"


def test_mixed_fleet_gives_bigger_nodes_more_layers() -> None:
    objects = render("mixed-fleet")
    nodes = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Pod"}
    layers = [s["layer_end"] - s["layer_start"] for s in stages(objects)]
    assert len(nodes) == 3 and layers == sorted(layers) and layers[0] < layers[-1]


def test_local_cpu_serves_the_demo_model_in_two_stages() -> None:
    assert [(s["layer_start"], s["layer_end"]) for s in stages(render("local-cpu"))] in ([(0, 3), (3, 6)],)


def _summaries_tool():  # type: ignore[no-untyped-def]
    import importlib.util

    spec = importlib.util.spec_from_file_location("summaries", EXAMPLES.parent / "tools" / "summaries.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_example_summary_is_what_inspect_makes_of_its_checkpoint_as_tools_summaries_writes_it() -> None:
    from modelfleet.cli import app as cli

    tool = _summaries_tool()
    assert sorted([*tool.SOURCES, *tool.HAND_WRITTEN]) == NAMES
    for name, source in tool.SOURCES.items():
        written = (EXAMPLES / "summaries" / f"{name}.json").read_text()
        assert written == tool.render(name), f"{name}.json is stale: run python tools/summaries.py"
        inspected = CliRunner().invoke(cli, ["inspect", str(EXAMPLES.parent / source)])
        assert inspected.exit_code == 0, inspected.output
        assert json.loads(inspected.stdout) == json.loads(written)
