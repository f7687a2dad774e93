"""The fleet plan and its planners: splits, node memory, validation, JSON and checkpoint sizes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open
from tiny import COMMON, CONFIGS, save_model

from modelfleet import plan as fleet_plan
from modelfleet import planner
from modelfleet.engine.cache_layout import REWIND_SLACK_POSITIONS
from modelfleet.engine.checkpoint import Checkpoint
from modelfleet.engine.spec import spec_from_config
from modelfleet.plan import FleetPlan, PlanError, ServingLimits
from modelfleet.planner import InfeasiblePlan

GiB = 1 << 30


# ---- splits ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_layers, stages, expected",
    [
        (4, 1, [(0, 4)]),
        (4, 2, [(0, 2), (2, 4)]),
        (5, 2, [(0, 3), (3, 5)]),
        (7, 3, [(0, 3), (3, 5), (5, 7)]),
        (3, 3, [(0, 1), (1, 2), (2, 3)]),
        (66, 11, [(6 * k, 6 * k + 6) for k in range(11)]),
    ],
)
def test_even_split_gives_contiguous_ranges_with_the_remainder_first(num_layers, stages, expected):
    assert planner.split_even(num_layers, stages) == expected


@pytest.mark.parametrize("num_layers, stages", [(3, 4), (3, 0)])
def test_even_split_refuses_stages_without_a_layer(num_layers, stages):
    with pytest.raises(PlanError, match="stages="):
        planner.split_even(num_layers, stages)


@pytest.mark.parametrize(
    "layers, embed, head, usable, kv, expected",
    [
        # equal nodes, equal layers: even
        ([10] * 6, 0, 0, [100, 100, 100], 0, [(0, 2), (2, 4), (4, 6)]),
        # nodes of 1:2:3 memory take layers 1:2:3
        ([10] * 12, 0, 0, [100, 200, 300], 0, [(0, 2), (2, 6), (6, 12)]),
        # the embedding weighs on the first stage, the head on the last
        ([10] * 4, 20, 0, [100, 100], 0, [(0, 1), (1, 4)]),
        ([10] * 4, 0, 20, [100, 100], 0, [(0, 3), (3, 4)]),
        # a KV reservation per layer counts like weights
        ([10] * 4, 0, 0, [60, 200], [40, 0, 0, 0], [(0, 1), (1, 4)]),
        # a large node still leaves every other stage a layer
        ([10] * 4, 0, 0, [50, 10_000], 0, [(0, 1), (1, 4)]),
        # uneven layers (a dense layer among MoE layers)
        ([10, 2, 10, 10], 0, 0, [100, 100], 0, [(0, 2), (2, 4)]),
    ],
)
def test_memory_split_follows_each_nodes_usable_memory(layers, embed, head, usable, kv, expected):
    assert planner.split_by_memory(layers, embed, head, usable, kv) == expected


def test_memory_split_keeps_every_stage_within_its_node_when_the_proportional_one_would_not():
    # 1:1 memory, but a 30-byte layer only fits the second node's 40 bytes next to one 10-byte layer
    ranges = planner.split_by_memory([10, 10, 30], 0, 0, [40, 40])
    assert ranges == [(0, 2), (2, 3)]


def test_an_infeasible_fleet_is_refused_with_the_missing_bytes_and_each_nodes_shortfall():
    with pytest.raises(InfeasiblePlan) as caught:
        planner.split_by_memory([10] * 12, 5, 5, [40, 40, 40], kv_bytes_per_layer=0, node_names=["a", "b", "c"])
    error = caught.value
    assert error.missing_bytes == 130 - 120
    assert error.shortfall_bytes == (5, 0, 5)
    assert "10 bytes" in str(error) and "missing" in str(error)
    assert "a (stage 0, layers [0, 4)) needs 45 bytes, has 40, short by 5 bytes" in str(error)
    assert "b (stage 1" not in str(error)


def test_a_fleet_with_enough_memory_in_all_but_no_fitting_contiguous_split_is_refused():
    with pytest.raises(InfeasiblePlan, match="no contiguous split") as caught:
        planner.split_by_memory([10, 50, 10], 0, 0, [40, 40, 40])
    assert caught.value.missing_bytes == 0
    assert caught.value.shortfall_bytes == (0, 10, 0)


def test_the_kv_reservation_alone_can_make_a_fleet_infeasible():
    assert planner.split_by_memory([10] * 4, 0, 0, [20, 20]) == [(0, 2), (2, 4)]
    with pytest.raises(InfeasiblePlan, match="8 bytes"):
        planner.split_by_memory([10] * 4, 0, 0, [20, 20], kv_bytes_per_layer=2)


def test_memory_split_refuses_a_kv_list_of_the_wrong_length():
    with pytest.raises(PlanError, match="kv_bytes_per_layer has 3 entries for 4 layers"):
        planner.split_by_memory([10] * 4, 0, 0, [100, 100], [1, 1, 1])


# ---- node memory ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "quantity, expected",
    [
        ("128974848", 128974848),
        (1024, 1024),
        ("1Ki", 1024),
        ("123Mi", 123 * 2**20),
        ("16Gi", 16 * GiB),
        ("1.5Gi", 1610612736),
        ("1Ti", 2**40),
        ("2k", 2000),
        ("129M", 129_000_000),
        ("8G", 8_000_000_000),
        ("1e3", 1000),
        ("1.5E2", 150),
        ("100m", 1),  # milli rounds up
        (" 64Gi ", 64 * GiB),
    ],
)
def test_kubernetes_quantities_parse_to_whole_bytes(quantity, expected):
    assert planner.parse_quantity(quantity) == expected


@pytest.mark.parametrize("quantity", ["12Q", "", "Gi", "1.5.3Gi", "1 Gi", "0x10", True])
def test_malformed_quantities_are_refused(quantity):
    with pytest.raises(PlanError, match="not a Kubernetes quantity"):
        planner.parse_quantity(quantity)


def _node(name: str, memory: str, labels: dict[str, str] | None = None, **allocatable: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": labels or {}},
        "status": {"allocatable": {"cpu": "8", "memory": memory, **allocatable}},
    }


def test_usable_memory_is_allocatable_memory_less_the_runtime_reserve():
    assert planner.usable_memory(_node("pc", "32Gi")) == 32 * GiB - planner.RUNTIME_RESERVE_BYTES
    assert planner.usable_memory(_node("pc", "32Gi"), runtime_reserve_bytes=0) == 32 * GiB
    assert planner.usable_memory(_node("tiny", "1Gi")) == 0


def test_an_integrated_gpu_adds_nothing_and_a_discrete_gpu_adds_its_memory():
    igpu = _node("ai-pc", "32Gi", **{"gpu.intel.com/i915": "1"})
    dgpu = _node("ws", "64Gi", {"nvidia.com/gpu.memory": "24576"}, **{"nvidia.com/gpu": "2"})
    assert planner.usable_memory(igpu, 0) == 32 * GiB
    assert planner.usable_memory(dgpu, 0) == 64 * GiB + 2 * 24 * GiB
    assert [planner.node_device(n) for n in (igpu, dgpu, _node("cpu", "8Gi"))] == ["GPU", "cuda", "cpu"]


def test_a_node_without_allocatable_memory_or_with_a_bad_quantity_is_named_in_the_error():
    with pytest.raises(PlanError, match="node 'x' has no status.allocatable.memory"):
        planner.usable_memory({"metadata": {"name": "x"}, "status": {}})
    with pytest.raises(PlanError, match="node 'y': status.allocatable.memory"):
        planner.usable_memory(_node("y", "lots"))


# ---- plan validation ------------------------------------------------------------------------


def _plan_fields(num_layers: int = 6, ranges: tuple[tuple[int, int], ...] = ((0, 3), (3, 6))) -> dict[str, Any]:
    stages = [
        {"stage_index": s, "layer_start": a, "layer_end": b, "address": f"stage-{s}.fleet:5555"}
        for s, (a, b) in enumerate(ranges)
    ]
    return {
        "model": {"path": "/models/m", "served_name": "m", "family": "qwen3_moe", "num_layers": num_layers},
        "groups": [{"group_index": 0, "stages": stages}],
    }


def _with(fields: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A deep copy of ``fields`` with the value at 'a.b.0.c' replaced (or added)."""
    copy = json.loads(json.dumps(fields))
    *parents, last = path.split(".")
    target: Any = copy
    for key in parents:
        target = target[int(key)] if key.isdigit() else target.setdefault(key, {})
    target[int(last) if last.isdigit() else last] = value
    return copy


@pytest.mark.parametrize(
    "path, value, named",
    [
        ("groups.0.stages.1.layer_start", 4, "groups[0].stages[1].layer_start=4 must equal stages[0].layer_end=3"),
        ("groups.0.stages.1.layer_start", 2, "groups[0].stages[1].layer_start=2"),
        ("groups.0.stages.0.layer_start", 1, "groups[0].stages[0].layer_start=1 must equal 0"),
        ("groups.0.stages.1.layer_end", 5, "groups[0].stages[1].layer_end=5 must equal model.num_layers=6"),
        ("groups.0.stages.0.layer_end", 0, "groups[0].stages[0].layer_end"),
        ("groups.0.stages.1.stage_index", 2, "groups[0].stages[1].stage_index=2 must be 1"),
        ("groups.0.stages.0.tp_size", 0, "groups[0].stages[0].tp_size"),
        ("groups.0.stages.0.stage_index", True, "groups[0].stages[0].stage_index"),
        ("groups.0.stages.0.weights_bytes", -1, "groups[0].stages[0].weights_bytes"),
        ("groups.0.stages.0.address", "stage-0", "groups[0].stages[0].address"),
        ("groups.0.stages.0.address", "stage-0:70000", "groups[0].stages[0].address"),
        ("groups.0.stages.0.device", "tpu", "groups[0].stages[0].device"),
        ("groups.0.stages.0.colour", "red", "groups[0].stages[0].colour"),
        ("groups.0.stages", [], "groups[0].stages"),
        ("groups.0.group_index", 1, "groups[0].group_index=1 must be 0"),
        ("groups", [], "groups"),
        ("model.num_layers", 0, "model.num_layers"),
        ("model.dtype", "float64", "model.dtype"),
        ("model.formats.experts", "int3", "model.formats.experts"),
        ("serving.window_rows", 0, "serving.window_rows"),
        ("serving.queue_timeout_seconds", 0, "serving.queue_timeout_seconds"),
        ("serving.max_streams", "16", "serving.max_streams"),
        ("version", 2, "version"),
    ],
)
def test_plan_validation_errors_name_the_field(path, value, named):
    with pytest.raises(PlanError) as caught:
        fleet_plan.build(**_with(_plan_fields(), path, value))
    assert named in str(caught.value)


def test_a_valid_plan_is_accepted_with_the_defaults_filled_in():
    plan = fleet_plan.build(**_plan_fields())
    assert plan.serving.window_rows == 8
    assert plan.stage(0, 1).num_layers == 3
    assert plan.stage(0, 0).tp_size == 1


def test_plans_are_frozen():
    plan = fleet_plan.build(**_plan_fields())
    with pytest.raises(ValueError):
        plan.stage(0, 0).layer_end = 4  # type: ignore[misc]


# ---- JSON and hash --------------------------------------------------------------------------


def test_a_plan_survives_a_json_round_trip_and_a_file(tmp_path):
    plan = fleet_plan.build(**_plan_fields(), serving={"max_streams": 4, "queue_timeout_seconds": 2.5})
    assert FleetPlan.from_json(plan.to_json()) == plan
    fleet_plan.save(plan, tmp_path / "plan.json")
    loaded = fleet_plan.load(tmp_path / "plan.json")
    assert loaded == plan
    assert loaded.plan_hash() == plan.plan_hash()


def test_the_plan_hash_is_stable_and_ignores_key_order_and_whitespace():
    plan = fleet_plan.build(**_plan_fields())
    reordered = json.dumps(dict(reversed(list(json.loads(plan.to_json()).items()))), indent=7)
    assert FleetPlan.from_json(reordered).plan_hash() == plan.plan_hash()
    assert fleet_plan.build(**_plan_fields()).plan_hash() == plan.plan_hash()
    assert len(plan.plan_hash()) == 64


def test_the_plan_hash_changes_when_anything_in_the_plan_changes():
    base = fleet_plan.build(**_plan_fields())
    moved = fleet_plan.build(**_plan_fields(ranges=((0, 2), (2, 6))))
    served = fleet_plan.build(**_with(_plan_fields(), "model.served_name", "other"))
    assert len({base.plan_hash(), moved.plan_hash(), served.plan_hash()}) == 3


def test_loading_a_missing_or_invalid_plan_file_names_the_file_and_the_field(tmp_path):
    with pytest.raises(PlanError, match="cannot read the fleet plan"):
        fleet_plan.load(tmp_path / "absent.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_with(_plan_fields(), "groups.0.stages.0.tp_size", 0)))
    with pytest.raises(PlanError, match=r"bad.json: .*groups\[0\]\.stages\[0\]\.tp_size"):
        fleet_plan.load(bad)
    bad.write_text("{not json")
    with pytest.raises(PlanError, match="invalid fleet plan"):
        fleet_plan.load(bad)


# ---- sizes from a checkpoint and whole plans -----------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "qwen3_moe"
    save_model("qwen3_moe", path, max_shard_size="20KB")
    return path


def _sizes_by_reading(model_dir: Path) -> dict[str, int]:
    """Independent reference: every tensor loaded through safetensors, sized from its data."""
    sizes: dict[str, int] = {}
    for file in model_dir.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensor = f.get_tensor(name)
                sizes[name] = tensor.numel() * tensor.element_size()
    return sizes


def test_layer_bytes_matches_the_tensors_while_reading_headers_only(tiny_model, monkeypatch):
    reference = _sizes_by_reading(tiny_model)

    def refuse(self, name):
        raise AssertionError(f"layer_bytes read tensor data ({name})")

    monkeypatch.setattr(Checkpoint, "read", refuse)
    sizes = planner.layer_bytes(tiny_model)
    for i, got in enumerate(sizes.per_layer):
        assert got == sum(n for name, n in reference.items() if name.startswith(f"model.layers.{i}."))
    assert sizes.embed_bytes == reference["model.embed_tokens.weight"]
    assert sizes.head_bytes == reference["model.norm.weight"] + reference["lm_head.weight"]
    assert not sizes.tied
    assert sum(sizes.per_layer) + sizes.embed_bytes + sizes.head_bytes == sum(reference.values())
    assert sizes.per_layer[1] < sizes.per_layer[0]  # layer 1 is dense (mlp_only_layers)


def test_layer_bytes_counts_floating_tensors_at_the_compute_dtype(tiny_model):
    stored, halved = planner.layer_bytes(tiny_model), planner.layer_bytes(tiny_model, "bfloat16")
    assert [2 * n for n in halved.per_layer] == list(stored.per_layer)
    with pytest.raises(PlanError, match="float64"):
        planner.layer_bytes(tiny_model, "float64")


def test_tied_embeddings_are_the_head_and_one_stage_holds_them_once(tiny_model, tmp_path):
    tied = tmp_path / "tied"
    shutil.copytree(tiny_model, tied)
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    sizes = planner.layer_bytes(tied)
    assert sizes.tied and sizes.head_matrix_bytes == sizes.embed_bytes
    everything = sum(sizes.per_layer) + sizes.embed_bytes + sizes.norm_bytes
    assert sizes.stage_bytes(0, 4) == everything
    assert sizes.stage_bytes(0, 2) + sizes.stage_bytes(2, 4) == everything + sizes.embed_bytes


def test_kv_reservation_per_layer_follows_the_attention_kind():
    qwen = spec_from_config({**COMMON, **CONFIGS["qwen3_moe"], "model_type": "qwen3_moe"})
    assert planner.kv_bytes_per_layer(qwen, 3, 100, "bfloat16") == [3 * 100 * 2 * 2 * 16 * 2] * 4
    oss = spec_from_config({**COMMON, **CONFIGS["gpt_oss"], "model_type": "gpt_oss"})
    window = 6 + REWIND_SLACK_POSITIONS
    per_position = 2 * 2 * 16 * 4
    assert planner.kv_bytes_per_layer(oss, 1, 1000, "float32") == [window * per_position, 1000 * per_position] * 2
    deepseek = spec_from_config({**COMMON, **CONFIGS["deepseek_v3"], "model_type": "deepseek_v3"})
    assert planner.kv_bytes_per_layer(deepseek, 1, 10, "float32") == [10 * (24 + 8) * 4] * 4


def test_a_plan_without_nodes_splits_evenly_and_accounts_every_byte(tiny_model):
    plan = planner.build_plan(tiny_model, 2, dtype="float32", serving=ServingLimits(max_streams=2, context_length=64))
    sizes = planner.layer_bytes(tiny_model, "float32")
    stages = plan.groups[0].stages
    assert [(s.layer_start, s.layer_end) for s in stages] == [(0, 2), (2, 4)]
    assert sum(s.weights_bytes for s in stages) == sum(sizes.per_layer) + sizes.embed_bytes + sizes.head_bytes
    assert all(s.kv_budget_bytes == 2 * 2 * 64 * 2 * 2 * 16 * 4 for s in stages)
    assert [s.address for s in stages] == ["127.0.0.1:5555", "127.0.0.1:5565"]
    assert plan.model.family == "qwen3_moe" and plan.model.num_layers == 4 and plan.model.served_name == "qwen3_moe"
    assert FleetPlan.from_json(plan.to_json()) == plan


def test_a_plan_over_unequal_nodes_gives_the_larger_node_more_layers(tiny_model):
    serving = ServingLimits(max_streams=64, context_length=512)  # 4 MiB of KV per layer in bfloat16
    nodes = [_node("big", "2Gi"), _node("small", "1Gi")]
    plan = planner.build_plan(tiny_model, 2, nodes, serving=serving, runtime_reserve_bytes=GiB - 6 * 2**20)
    assert [(s.layer_start, s.layer_end) for s in plan.groups[0].stages] == [(0, 3), (3, 4)]
    with pytest.raises(InfeasiblePlan, match="small"):
        planner.build_plan(tiny_model, 2, nodes, serving=serving, runtime_reserve_bytes=GiB - 2**20)


def test_a_plan_of_two_groups_takes_its_nodes_group_after_group(tiny_model):
    nodes = [_node(f"n{i}", "4Gi", **({"nvidia.com/gpu": "1"} if i >= 2 else {})) for i in range(4)]
    plan = planner.build_plan(tiny_model, 2, nodes, groups=2, address_of=lambda g, s: f"g{g}-s{s}.fleet:7000")
    assert [[s.device for s in g.stages] for g in plan.groups] == [["cpu", "cpu"], ["cuda", "cuda"]]
    assert plan.stage(1, 0).address == "g1-s0.fleet:7000"
    with pytest.raises(PlanError, match="3 nodes given for 2 group"):
        planner.build_plan(tiny_model, 2, nodes[:3], groups=2)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_bytes_planned_in_weight_formats_are_the_bytes_a_shard_holds_in_them(tiny_checkpoint, family):
    from modelfleet.engine.formats.plan import FormatPlan
    from modelfleet.engine.shard import Shard
    from modelfleet.plan import Formats

    path, _ = tiny_checkpoint(family)
    plain = planner.layer_bytes(path, "bfloat16")
    planned = plain.in_formats(Formats(experts="int4", attention="int8", head="int8", embeddings="int8"))
    engine_formats = FormatPlan(experts="int4", attention="int8", head="int8", embeddings="int8")
    shard = Shard.load(path, dtype="bfloat16", formats=engine_formats)
    held = shard.bytes_by_role  # one shard: every layer, embeddings, norm and head
    role_total = {role: sum(t.get(f"{role}/plain", 0) for t in plain.role_bytes) for role in ("experts", "attention")}
    for role, fmt in (("experts", "int4"), ("attention", "int8")):
        # the role's matrices in their format (kernel layouts counted as this CPU holds them)
        assert held[role][fmt] == sum(t[f"{role}/{fmt}"] for t in plain.role_bytes), role
        assert held[role][fmt] < 0.6 * role_total[role]
    assert held["head"]["int8"] == plain.outer_role_bytes["head/int8"] == planned.head_matrix_bytes
    assert held["embeddings"]["int8"] == plain.outer_role_bytes["embeddings/int8"] == planned.embed_bytes
    expected = sum(planned.per_layer) + planned.embed_bytes + planned.norm_bytes + planned.head_matrix_bytes
    assert abs(shard.weights_bytes - expected) <= 0.02 * expected  # routers held in float32 ride on top


def test_a_tied_head_is_planned_as_the_packed_embedding_table(tiny_model, tmp_path):
    from modelfleet.plan import Formats

    tied = tmp_path / "tied"
    shutil.copytree(tiny_model, tied)
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    sizes = planner.layer_bytes(tied, "bfloat16").in_formats(Formats(embeddings="int8", head="int8"))
    assert sizes.tied and sizes.head_matrix_bytes == sizes.embed_bytes
    stored = planner.format_bytes((128, 64), "int8", kernel_layouts=False)
    assert sizes.embed_bytes == stored < planner.layer_bytes(tied, "bfloat16").embed_bytes


def test_plain_formats_leave_the_sizes_as_counted_and_a_summary_plans_in_formats(tiny_checkpoint):
    from modelfleet.operator.summary import inspect_checkpoint
    from modelfleet.plan import Formats

    path, _ = tiny_checkpoint("qwen3_moe")
    sizes = planner.layer_bytes(path, "bfloat16")
    unchanged = sizes.in_formats(Formats())
    assert (unchanged.per_layer, unchanged.head_matrix_bytes) == (sizes.per_layer, sizes.head_matrix_bytes)
    int4 = Formats(experts="int4")
    summary = inspect_checkpoint(path, "bfloat16")
    assert summary.sizes(int4) == sizes.in_formats(int4)
    assert sum(summary.sizes(int4).per_layer) < sum(summary.sizes().per_layer)
