"""Combinations no stage could run are refused when the fleet is planned, in one line naming the
option, the limit and the fix: by the planner's pure functions (table tests), by `modelfleet plan`
and `up` before any process starts, and by the operator's placement from a model summary."""

from __future__ import annotations

from pathlib import Path

import pytest
from fleet_fixtures import node, summary
from typer.testing import CliRunner

from modelfleet.cli import app
from modelfleet.operator.placement import Infeasible, Placement, place
from modelfleet.operator.spec import parse_spec
from modelfleet.operator.summary import inspect_checkpoint
from modelfleet.plan import PlanError
from modelfleet.planner import DEFAULT_CONTEXT_CAP, context_length_for, device_refusal, tensor_refusal

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"


@pytest.mark.parametrize(
    "device, cuda_devices, refused",
    [
        ("cpu", 0, None),
        ("cpu", None, None),
        ("cuda", None, None),  # the stages run elsewhere: only the name is checked
        ("cuda", 1, None),
        ("cuda:1", 2, None),
        ("gpu", None, "--device 'gpu' is not a device; choose cpu, cuda or cuda:N"),
        ("GPU", 1, "choose cpu, cuda or cuda:N"),
        ("cuda:x", 1, "is not a device"),
        ("cuda", 0, "--device cuda: this machine has no CUDA device (torch sees none); use --device cpu"),
        ("cuda:0", 0, "no CUDA device"),
        ("cuda:2", 2, "--device cuda:2: this machine has 2 CUDA device(s), cuda:0..cuda:1"),
    ],
)  # fmt: skip
def test_a_device_is_refused_when_torch_has_no_such_device(device, cuda_devices, refused):
    found = device_refusal(device, cuda_devices)
    assert found is None if refused is None else refused in found


@pytest.mark.parametrize(
    "split, tensor, refused",
    [
        ((("num_attention_heads", 8), ("num_key_value_heads", 2)), 1, None),
        ((("num_attention_heads", 8), ("num_key_value_heads", 2)), 2, None),
        ((("num_attention_heads", 8), ("num_key_value_heads", 2)), 3,
         "--tensor 3 does not divide the model's num_attention_heads=8; choose a tensor size from 1, 2"),
        ((("num_attention_heads", 8), ("num_key_value_heads", 2)), 4,
         "--tensor 4 does not divide the model's num_key_value_heads=2; choose a tensor size from 1, 2"),
        ((("num_attention_heads", 12), ("o_groups", 4)), 4, None),
    ],
)  # fmt: skip
def test_a_tensor_size_is_refused_unless_it_divides_every_split_count(split, tensor, refused):
    assert tensor_refusal(split, tensor) == refused


def test_the_context_defaults_to_the_models_positions_capped_and_more_is_refused_naming_both():
    assert context_length_for(512, None) == 512
    assert context_length_for(10**6, None) == DEFAULT_CONTEXT_CAP
    assert context_length_for(512, 512) == 512
    with pytest.raises(PlanError, match=r"--context-length 513 is over the model's max_position_embeddings=512"):
        context_length_for(512, 513)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--device", "gpu"], "--device 'gpu' is not a device; choose cpu, cuda or cuda:N"),
        (["--tensor", "3"], "--tensor 3 does not divide the model's num_attention_heads=8"),
        (["--context-length", "5000"], "--context-length 5000 is over the model's max_position_embeddings=4096"),
    ],
)
def test_up_refuses_an_impossible_fleet_in_one_line_before_starting_anything(args, message, monkeypatch):
    monkeypatch.setattr("modelfleet.agent.launcher.LocalFleet.start", lambda self: pytest.fail("a stage started"))
    result = CliRunner().invoke(app, ["up", "--model", str(DEMO), *args])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.output


def test_up_refuses_cuda_on_a_machine_without_one(monkeypatch):
    monkeypatch.setattr("modelfleet.planner.local_cuda_devices", lambda: 0)
    result = CliRunner().invoke(app, ["up", "--model", str(DEMO), "--device", "cuda"])
    assert result.exit_code == 2 and "this machine has no CUDA device" in result.output
    assert "Traceback" not in result.output


def test_plan_refuses_a_tensor_size_that_does_not_divide_the_heads(tmp_path):
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["plan", "--model", str(DEMO), "--tensor", "3", "--out", str(out)])
    assert result.exit_code == 2 and "--tensor 3 does not divide" in result.output and not out.exists()


def test_the_operator_refuses_from_the_summary_what_the_command_line_refuses():
    demo = inspect_checkpoint(DEMO)
    assert demo.tensor_split == {"num_attention_heads": 8, "num_key_value_heads": 2}
    assert demo.max_position_embeddings == 4096

    def placed(**fields):  # type: ignore[no-untyped-def]
        spec = parse_spec({"model": {"uri": "pvc://models/demo", "servedName": "demo"}, **fields})
        model = summary(6, tensor_split=demo.tensor_split, max_position_embeddings=4096)
        return place(spec, model, [node(n) for n in "abcdef"], "demo", "ai")

    assert isinstance(placed(parallelism={"pipeline": 2, "tensor": 2}), Placement)
    tensor = placed(parallelism={"pipeline": 2, "tensor": 3})
    assert isinstance(tensor, Infeasible) and tensor.reason == "InvalidForModel"
    assert tensor.message.startswith("parallelism.tensor 3 does not divide the model's num_attention_heads=8")
    context = placed(serving={"contextLength": 8192})
    assert isinstance(context, Infeasible) and "serving.contextLength 8192 is over" in context.message


@pytest.mark.parametrize("command", ["up", "plan"])
def test_every_option_of_up_and_plan_says_what_it_does(command):
    from typer.main import get_command

    params = get_command(app).commands[command].params  # type: ignore[attr-defined]
    assert [p.opts for p in params if not p.help and not p.hidden] == []


def test_served_name_is_the_model_name_the_plan_gives_the_gateway(tmp_path):
    import json

    out = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["plan", "--model", str(DEMO), "--served-name", "py-demo", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["model"]["served_name"] == "py-demo"
    bad = CliRunner().invoke(app, ["plan", "--model", str(DEMO), "--served-name", "two words", "--out", str(out)])
    assert bad.exit_code == 2 and "served_name" in bad.output
