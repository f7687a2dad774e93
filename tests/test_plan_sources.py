"""Every fact has one home: ports, the weight-format vocabulary, a layer's cache layout, the even
split and the plan assembler are each defined once and asked for by the planner, the command
line, the agents' clients and the operator; and a stage's backend is the plan's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from tiny import COMMON, CONFIGS

from modelfleet import planner
from modelfleet.engine.cache_layout import REWIND_SLACK_POSITIONS, cache_layouts
from modelfleet.engine.errors import InputError
from modelfleet.engine.format_names import PACKED_FORMATS, ROLE_FORMATS, ROLES, WEIGHT_FORMATS
from modelfleet.engine.spec import spec_from_config
from modelfleet.engine.split import even_split
from modelfleet.plan import (
    PORTS_PER_STAGE,
    FleetPlan,
    Formats,
    PlanError,
    ServingLimits,
    StagePlan,
    stage_at,
    stage_port_span,
)

ROOT = Path(__file__).resolve().parents[1]
CRD = yaml.safe_load((ROOT / "crds" / "modelfleets.modelfleet.io.yaml").read_text())
SPEC_SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def _spec(family: str, **overrides: Any):  # type: ignore[no-untyped-def]
    return spec_from_config({**COMMON, **CONFIGS[family], "model_type": family, **overrides})


def _stage(port: int = 7000, tp_size: int = 1) -> StagePlan:
    return StagePlan(stage_index=0, layer_start=0, layer_end=1, tp_size=tp_size, address=f"h:{port}")


# ---- 1. ports ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tp_size, ports",
    [
        (1, (7000, 7001, 7002)),
        (2, (7000, 7001, 7002, 7003, 7004)),
        (3, (7000, 7001, 7002, 7003, 7004, 7005)),
    ],
)
def test_a_stage_derives_every_port_from_its_address(tp_size: int, ports: tuple[int, ...]) -> None:
    stage = _stage(7000, tp_size)
    assert (stage.http_port, stage.client_port, stage.rendezvous_port) == (7001, 7002, 7003)
    assert stage.ports == ports
    assert max(stage.ports) < stage.port + stage.port_span() == stage.port + stage_port_span(tp_size)


def test_tensor_ranks_serve_http_on_their_own_host_or_after_the_rendezvous_on_a_shared_one() -> None:
    stage = _stage(7000, 3)
    assert [stage.rank_http_port(r, shared_host=False) for r in range(3)] == [7001, 7001, 7001]
    assert [stage.rank_http_port(r, shared_host=True) for r in range(3)] == [7001, 7004, 7005]
    assert stage.port_span(shared_host=False) == PORTS_PER_STAGE


@pytest.mark.parametrize("tensor, stride", [(1, 10), (7, 10), (8, 20), (17, 20), (18, 30)])
def test_local_stages_are_a_round_stride_apart_and_never_share_a_port(tensor: int, stride: int) -> None:
    address = planner.local_address(6000, stages=3, tp_size=tensor)
    stages = [StagePlan(stage_index=0, layer_start=0, layer_end=1, tp_size=tensor, address=address(g, s))
              for g in range(2) for s in range(3)]  # fmt: skip
    assert [s.port for s in stages] == [6000 + stride * k for k in range(6)]
    every = [port for s in stages for port in s.ports]
    assert len(every) == len(set(every)) and planner.PORT_STRIDE >= PORTS_PER_STAGE


def test_the_operator_and_the_clients_ask_the_plan_for_ports() -> None:
    import zmq

    from modelfleet.agent.client import FleetClient
    from modelfleet.operator import names

    pod = stage_at(f"pod:{names.AGENT_PORT}")
    assert (pod.http_port, pod.rendezvous_port) == (names.AGENT_HTTP_PORT, names.TENSOR_PORT)
    with FleetClient("127.0.0.1:7000") as by_address, FleetClient(stage_at("127.0.0.1:7000")) as by_stage:
        endpoints = {c.socket.getsockopt_string(zmq.LAST_ENDPOINT) for c in (by_address, by_stage)}
    assert endpoints == {"tcp://127.0.0.1:7002"}


def test_a_head_link_polls_the_heads_http_port_and_submits_to_its_client_port() -> None:
    from modelfleet.agent.headlink import HeadLink

    link = HeadLink("head.fleet:7000")
    assert (link.endpoint, link.status_url) == ("tcp://head.fleet:7002", "http://head.fleet:7001/status")


def test_a_bad_address_is_refused_naming_it() -> None:
    with pytest.raises(PlanError, match="address"):
        stage_at("no-port")


# ---- 2. the weight-format vocabulary ----------------------------------------------------------


def test_the_engine_registers_exactly_the_vocabulary() -> None:
    from modelfleet.engine.formats import format_names

    assert format_names() == WEIGHT_FORMATS
    assert "int4_sym" in WEIGHT_FORMATS and set(PACKED_FORMATS) <= set(WEIGHT_FORMATS)


def test_the_engine_format_plan_and_the_fleet_plan_accept_the_same_formats_per_role() -> None:
    from modelfleet.engine.formats.base import FormatError
    from modelfleet.engine.formats.plan import FormatPlan

    for role in ROLES:
        for name in WEIGHT_FORMATS:
            engine_ok = fleet_ok = True
            try:
                FormatPlan(**{role: name})
            except FormatError:
                engine_ok = False
            try:
                Formats(**{role: name})
            except ValueError:
                fleet_ok = False
            assert engine_ok == fleet_ok == (name in ROLE_FORMATS[role]), (role, name)


def test_the_crd_lists_each_roles_formats_from_the_vocabulary() -> None:
    formats = SPEC_SCHEMA["properties"]["model"]["properties"]["formats"]["properties"]
    assert {role: tuple(formats[role]["enum"]) for role in ROLES} == ROLE_FORMATS


def test_the_operator_spec_takes_int4_sym_experts() -> None:
    from modelfleet.operator.spec import SpecError, parse_spec

    spec = parse_spec({"model": {"uri": "hf://a/b", "servedName": "m", "formats": {"experts": "int4_sym"}}})
    assert spec.model.formats.experts == "int4_sym"
    with pytest.raises(SpecError, match="attention"):
        parse_spec({"model": {"uri": "hf://a/b", "servedName": "m", "formats": {"attention": "mxfp4"}}})


def test_modelfleet_plan_accepts_int4_sym_experts_and_refuses_unknown_formats(tiny_checkpoint, tmp_path) -> None:
    from typer.testing import CliRunner

    from modelfleet.cli import app

    path, _ = tiny_checkpoint("qwen3_moe")
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["plan", "--model", str(path), "--experts", "int4_sym", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["model"]["formats"]["experts"] == "int4_sym"
    result = CliRunner().invoke(app, ["plan", "--model", str(path), "--attention", "mxfp4", "--out", str(out)])
    assert result.exit_code == 2 and "not supported for attention" in result.output


# ---- 3. a layer's cache layout ----------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_the_planners_kv_bytes_per_layer_are_what_a_loaded_shard_allocates(tiny_checkpoint, family: str) -> None:
    from modelfleet.engine.shard import Shard
    from modelfleet.operator.summary import inspect_checkpoint

    path, _ = tiny_checkpoint(family)
    spec = _spec(family)
    shard = Shard.load(path, dtype="float32")
    for streams, context in ((1, 4), (3, 100), (2, 128)):
        shard.allocate_cache(max_slots=streams, max_context=context)
        allocated = [kv.nbytes for kv in shard.kv]
        assert planner.kv_bytes_per_layer(spec, streams, context, "float32") == allocated, (streams, context)
        assert inspect_checkpoint(path, "float32").kv_bytes(streams, context) == allocated, (streams, context)


def test_gpt_oss_without_layer_types_alternates_sliding_and_full_layers_in_the_planner_too() -> None:
    spec = _spec("gpt_oss", layer_types=None)
    per_position = 2 * spec.num_kv_heads * spec.head_dim * 4
    window = 6 + REWIND_SLACK_POSITIONS
    assert planner.kv_bytes_per_layer(spec, 1, 1000, "float32") == [window * per_position, 1000 * per_position] * 2


@pytest.mark.parametrize(
    "family, overrides, windows, values_per_position",
    [
        ("qwen3_moe", {}, [None] * 4, 2 * 2 * 16),
        ("mixtral", {}, [None] * 4, 2 * 2 * 16),
        ("mixtral", {"sliding_window": 5}, [5] * 4, 2 * 2 * 16),
        ("gpt_oss", {}, [6, None, 6, None], 2 * 2 * 16),
        ("deepseek_v3", {}, [None] * 4, 24 + 8),
    ],
)
def test_each_family_answers_its_cache_layout_from_the_spec(family, overrides, windows, values_per_position) -> None:
    spec = _spec(family, **overrides)
    assert [{e.window for e in c.entries.values()} for c in cache_layouts(spec)] == [{w} for w in windows]
    assert {sum(e.values_per_row for e in c.entries.values()) for c in cache_layouts(spec)} == {values_per_position}


def test_a_tensor_rank_caches_its_share_of_attention_heads_but_all_of_an_mla_latent() -> None:
    (gqa, *_), (mla, *_) = cache_layouts(_spec("qwen3_moe")), cache_layouts(_spec("deepseek_v3"))
    assert {name: e.shape for name, e in gqa.for_rank(2).entries.items()} == {"k": (1, 16), "v": (1, 16)}
    assert mla.for_rank(2) == mla


def test_a_sliding_layer_keeps_its_window_plus_the_one_rewind_slack(tiny_checkpoint) -> None:
    from modelfleet.engine.shard import Shard

    path, _ = tiny_checkpoint("gpt_oss")
    shard = Shard.load(path, dtype="float32")
    shard.allocate_cache(max_slots=1, max_context=500)
    assert [kv.capacity for kv in shard.kv] == [6 + REWIND_SLACK_POSITIONS, 500] * 2


# ---- 4. one even split ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_layers, parts, expected",
    [
        (10, 3, [(0, 4), (4, 7), (7, 10)]),
        (10, 4, [(0, 3), (3, 6), (6, 8), (8, 10)]),
        (4, 4, [(0, 1), (1, 2), (2, 3), (3, 4)]),
        (61, 1, [(0, 61)]),
    ],
)
def test_the_even_split_gives_the_first_stages_the_extra_layers(num_layers, parts, expected) -> None:
    assert even_split(num_layers, parts) == expected == planner.split_even(num_layers, parts)


@pytest.mark.parametrize("num_layers, parts, why", [(3, 4, "exceeds the model's 3 layers"), (3, 0, "must be >= 1")])
def test_the_even_split_refuses_a_stage_without_a_layer(num_layers, parts, why) -> None:
    with pytest.raises(InputError, match=why):
        even_split(num_layers, parts)
    with pytest.raises(PlanError, match=why):
        planner.split_even(num_layers, parts)


# ---- 5. one plan assembler --------------------------------------------------------------------


def test_the_assembler_places_every_stage_and_accounts_its_bytes() -> None:
    sizes = planner.LayerBytes((10, 20, 30), embed_bytes=5, norm_bytes=1, head_matrix_bytes=7, tied=False)
    model = {"path": "/m", "served_name": "m", "family": "qwen3_moe", "num_layers": 3, "dtype": "float32"}
    plan = planner.assemble_plan(
        model, [[(0, 1), (1, 3)], [(0, 2), (2, 3)]], sizes, [100, 200, 300],
        address_of=lambda g, s: f"g{g}s{s}:7000", device_of=lambda g, s: "cuda" if g else "cpu",
        tp_size=2, backend="openvino", serving={"max_streams": 4, "microbatches": 2},
    )  # fmt: skip
    rows = [(s.address, s.device, s.tp_size, s.backend, s.weights_bytes, s.kv_budget_bytes)
            for g in plan.groups for s in g.stages]  # fmt: skip
    assert rows == [
        ("g0s0:7000", "cpu", 2, "openvino", 15, 100),
        ("g0s1:7000", "cpu", 2, "openvino", 58, 500),
        ("g1s0:7000", "cuda", 2, "openvino", 35, 300),
        ("g1s1:7000", "cuda", 2, "openvino", 38, 300),
    ]
    assert plan.serving.microbatches == 2


def test_the_assembler_refuses_ranges_that_miss_a_layer_naming_the_field() -> None:
    sizes = planner.LayerBytes((1, 1), 0, 0, 0, False)
    model = {"path": "/m", "served_name": "m", "family": "qwen3_moe", "num_layers": 2}
    with pytest.raises(PlanError, match=r"groups\[0\].stages\[0\].layer_end=1 must equal model.num_layers=2"):
        planner.assemble_plan(model, [[(0, 1)]], sizes, [0, 0], address_of=lambda g, s: "h:1")


def test_the_operator_and_modelfleet_plan_assemble_the_same_plan_from_the_same_decisions(tiny_checkpoint) -> None:
    from modelfleet.operator.placement import Placement, place
    from modelfleet.operator.spec import parse_spec
    from modelfleet.operator.summary import inspect_checkpoint

    path, _ = tiny_checkpoint("qwen3_moe")
    node = {"metadata": {"name": "n"}, "status": {"allocatable": {"memory": "64Gi", "cpu": "8"}}}
    spec = parse_spec({"model": {"uri": "hostpath:///m", "servedName": "m"}, "parallelism": {"pipeline": 1},
                       "serving": {"maxStreams": 2, "contextLength": 64}})  # fmt: skip
    placement = place(spec, inspect_checkpoint(path, "bfloat16"), [node], "f", "ns")
    assert isinstance(placement, Placement)
    local = planner.build_plan(path, 1, dtype="bfloat16", serving=ServingLimits(max_streams=2, context_length=64))
    ours, theirs = placement.plan.stage(0, 0), local.stage(0, 0)
    same = ("layer_start", "layer_end", "tp_size", "backend", "device", "weights_bytes", "kv_budget_bytes")
    assert {f: getattr(ours, f) for f in same} == {f: getattr(theirs, f) for f in same}


# ---- 6. names: groups are pipeline replicas, microbatches share frames ------------------------


def test_the_plan_names_microbatches_and_groups_and_no_stream_groups() -> None:
    from modelfleet.plan import FleetPlan

    schema = json.dumps(FleetPlan.model_json_schema())
    assert "microbatches" in schema and "stream_groups" not in schema
    crd_spec = SPEC_SCHEMA["properties"]
    assert "pipeline replicas" in crd_spec["replicas"]["description"]


def test_modelfleet_up_takes_groups_and_microbatches(tiny_checkpoint) -> None:
    from modelfleet.commands.fleet import make_plan

    path, _ = tiny_checkpoint("qwen3_moe")
    plan = make_plan(path, 2, groups=2, microbatches=3, base_port=40000)
    assert len(plan.groups) == 2 and plan.serving.microbatches == 3
    assert plan.stage(1, 0).port == 40020


def test_up_and_plan_help_say_groups_are_pipeline_replicas() -> None:
    from typer.testing import CliRunner

    from modelfleet.cli import app

    for command in ("up", "plan"):
        text = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"}).output
        assert "--groups" in text and "--microbatches" in text and "Pipeline replicas" in text, command
        assert "--replicas" not in text


# ---- 7. the backend per stage -----------------------------------------------------------------


def test_modelfleet_plan_defaults_the_context_to_the_models_positions_and_refuses_more_naming_both(
    tiny_checkpoint, tmp_path
) -> None:
    """Issue 30, item 9: the default 2048 once planned past a 512-position model; `up` then
    stopped with a CapacityError when the stages loaded."""
    from typer.testing import CliRunner

    from modelfleet.cli import app

    path, _ = tiny_checkpoint("qwen3_moe")
    positions = json.loads((path / "config.json").read_text())["max_position_embeddings"]
    assert positions < 2048  # the tiny model is the case the old default broke
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["plan", "--model", str(path), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["serving"]["context_length"] == positions
    result = CliRunner().invoke(app, ["plan", "--model", str(path), "--context-length", "256", "--out", str(out)])
    assert result.exit_code == 0 and json.loads(out.read_text())["serving"]["context_length"] == 256, result.output
    out.unlink()
    asked = ["plan", "--model", str(path), "--context-length", str(positions + 1), "--out", str(out)]
    result = CliRunner().invoke(app, asked)
    assert result.exit_code == 2 and not out.exists(), result.output
    assert (
        f"--context-length {positions + 1}" in result.output and f"max_position_embeddings={positions}" in result.output
    )


def test_modelfleet_plan_gives_each_stage_its_backend_one_for_all_or_one_per_stage(tiny_checkpoint, tmp_path) -> None:
    from typer.testing import CliRunner

    from modelfleet.cli import app

    path, _ = tiny_checkpoint("qwen3_moe")
    assert {s.backend for s in planner.build_plan(path, 2, backend="openvino").groups[0].stages} == {"openvino"}
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["plan", "--model", str(path), "--stages", "2", "--backend", "torch,openvino",
                                      "--out", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert [s.backend for s in FleetPlan.from_json(out.read_text()).groups[0].stages] == ["torch", "openvino"]
    with pytest.raises(PlanError, match="backend lists 3 backends for 2 stages"):
        planner.build_plan(path, 2, backend="torch,openvino,torch")
    with pytest.raises(PlanError, match="backend tpu is unknown"):
        planner.build_plan(path, 2, backend="torch,tpu")
    assert {s.backend for s in planner.build_plan(path, 2).groups[0].stages} == {"torch"}


def test_the_operator_writes_the_specs_backend_into_every_stage_and_no_backend_variable(tiny_checkpoint) -> None:
    from modelfleet.operator import objects
    from modelfleet.operator.placement import Placement, place
    from modelfleet.operator.spec import parse_spec
    from modelfleet.operator.summary import inspect_checkpoint

    path, _ = tiny_checkpoint("qwen3_moe")
    nodes = [{"metadata": {"name": f"n{i}"}, "status": {"allocatable": {"memory": "64Gi", "cpu": "8",
              "gpu.intel.com/xe": "1"}}} for i in range(2)]  # fmt: skip
    spec = parse_spec({"model": {"uri": "hostpath:///m", "servedName": "m"}, "backend": "openvino",
                       "accelerator": {"profile": "intel-igpu"}, "parallelism": {"pipeline": 2},
                       "serving": {"contextLength": 512}})  # fmt: skip
    placement = place(spec, inspect_checkpoint(path, "bfloat16"), nodes, "f", "ns")
    assert isinstance(placement, Placement)
    assert {(s.backend, s.device) for s in placement.plan.groups[0].stages} == {("openvino", "GPU")}
    fleet = {"metadata": {"name": "f", "namespace": "ns", "uid": "u", "generation": 1}, "spec": {}}
    pod = objects.stage_pod(fleet, spec, placement, placement.members[0])
    assert "MF_BACKEND" not in {e["name"] for e in pod["spec"]["containers"][0]["env"]}
