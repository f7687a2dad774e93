"""A plan's ``model.formats`` reach the stage agents: a fleet serves in the formats it was planned in."""

from __future__ import annotations

import json
from pathlib import Path

from test_pipeline import prompts_and_params
from test_tensor_fleet import free_base_port

from modelfleet.agent.client import FleetClient
from modelfleet.agent.launcher import LocalFleet, fetch_json
from modelfleet.agent.stage import format_plan
from modelfleet.commands.fleet import make_plan
from modelfleet.engine.formats.plan import FormatPlan
from modelfleet.engine.generate import LocalModel, generate_batch
from modelfleet.plan import FleetPlan, Formats


def test_plain_plan_formats_keep_roles_as_stored_and_quantized_ones_are_applied() -> None:
    assert format_plan(Formats()) is None
    assert format_plan(Formats(experts="int4", attention="bf16", head="int8")) == FormatPlan(
        experts="int4", head="int8"
    )
    assert format_plan(Formats(experts="mxfp4", attention="fp32")) == FormatPlan(experts="mxfp4")


def test_a_fleet_planned_with_int4_experts_and_int8_attention_serves_in_them(tiny_checkpoint, tmp_path: Path) -> None:
    path, _ = tiny_checkpoint("qwen3_moe")
    plan = make_plan(path, 1, max_streams=4, context_length=256, window_rows=4, base_port=free_base_port())
    document = json.loads(plan.to_json())
    document["model"]["formats"] = {"experts": "int4", "attention": "int8", "head": "bf16"}
    plan = FleetPlan.from_json(json.dumps(document))
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(plan.to_json())
    stage = plan.groups[0].stages[0]
    prompts, params = prompts_and_params(4)
    with (tmp_path / "fleet.log").open("w") as log:
        fleet = LocalFleet(plan, plan_path, out=log)
        fleet.start()
        try:
            fleet.wait_ready(120)
            status = fetch_json(f"http://{stage.host}:{stage.port + 1}/status")
            with FleetClient(stage.address, timeout_seconds=60) as client:
                results = client.wait([client.submit(p, s) for p, s in zip(prompts, params, strict=True)])
        finally:
            fleet.stop()
    assert status is not None
    assert set(status["bytes_by_role"]["experts"]) == {"int4"}
    assert set(status["bytes_by_role"]["attention"]) == {"int8"}
    expected = LocalModel.load(path, max_slots=4, max_context=256, formats=FormatPlan(experts="int4", attention="int8"))
    assert [r.token_ids for r in results] == [r.token_ids for r in generate_batch(expected, prompts, params)]


def test_plan_command_sizes_stages_in_the_formats_asked_for_and_names_a_bad_one(
    tiny_checkpoint, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from modelfleet.cli import app

    path, _ = tiny_checkpoint("qwen3_moe")
    runner = CliRunner()
    plans = {}
    for name, options in (("plain", []), ("packed", ["--experts", "int4", "--attention", "int8"])):
        out = tmp_path / f"{name}.json"
        result = runner.invoke(app, ["plan", "--model", str(path), "--stages", "2", "--out", str(out), *options])
        assert result.exit_code == 0, result.output
        plans[name] = FleetPlan.from_json(out.read_text())
    packed = plans["packed"]
    assert (packed.model.formats.experts, packed.model.formats.attention) == ("int4", "int8")
    for plain_stage, packed_stage in zip(plans["plain"].groups[0].stages, packed.groups[0].stages, strict=True):
        assert packed_stage.weights_bytes < 0.6 * plain_stage.weights_bytes
    result = runner.invoke(app, ["plan", "--model", str(path), "--experts", "int3", "--out", str(tmp_path / "x.json")])
    assert result.exit_code == 2 and "--experts 'int3' is not a weight format" in result.output


def test_the_plan_of_a_quantized_checkpoint_records_the_formats_it_serves(tmp_path: Path) -> None:
    """The bundled demo stores int4 experts and int8 attention (head and embeddings plain, in the
    compute dtype): `modelfleet plan` says so, where it said bf16 for every role, and its stages load it."""
    from typer.testing import CliRunner

    from modelfleet.cli import app

    demo = Path(__file__).resolve().parents[1] / "models" / "demo"
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["plan", "--model", str(demo), "--stages", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    model = FleetPlan.from_json(out.read_text()).model
    plain = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[model.dtype]  # the compute dtype's
    formats = model.formats
    assert formats == Formats(experts="int4", attention="int8", head=plain, embeddings=plain)
    assert format_plan(formats) == FormatPlan(experts="int4", attention="int8")  # the checkpoint's own: loads as stored


def test_an_agent_asked_for_a_backend_or_device_it_lacks_says_so_before_loading(
    tiny_checkpoint, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from modelfleet.cli import app

    path, _ = tiny_checkpoint("qwen3_moe")
    plan = make_plan(path, 1, base_port=free_base_port())
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(plan.to_json())
    runner = CliRunner()
    document = json.loads(plan.to_json())
    document["groups"][0]["stages"][0]["backend"] = "openvino"
    document["groups"][0]["stages"][0]["device"] = "NPU"
    plan_path.write_text(FleetPlan.from_json(json.dumps(document)).to_json())
    result = runner.invoke(app, ["agent", "--plan", str(plan_path), "--stage", "0"])
    assert result.exit_code == 2 and "device 'NPU'" in result.output and "use device cpu or GPU" in result.output
    document["groups"][0]["stages"][0]["backend"] = "torch"
    document["groups"][0]["stages"][0]["device"] = "GPU.0"
    plan_path.write_text(FleetPlan.from_json(json.dumps(document)).to_json())
    result = runner.invoke(app, ["agent", "--plan", str(plan_path), "--stage", "0"])
    assert result.exit_code == 2 and "'GPU.0' is an OpenVINO device" in result.output
