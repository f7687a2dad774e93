"""benchmarks/expert_store.py's whole-model mode (--model): a tiny random qwen3_moe through the
engine's load path, resident and capped through the serving path's expert stores, every
configuration's rows, greedy tokens against the uncapped run, the CSV and the SVG sweep plot.
On a CPU-only machine the "device" is the CPU stand-in: this checks the mechanics, never a rate."""

from __future__ import annotations

import csv
import importlib.util
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from modelfleet.engine.expert_placement import MoELayer, plan_expert_placement

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "expert_store.py"
spec = importlib.util.spec_from_file_location("expert_store_bench", BENCH)
assert spec is not None and spec.loader is not None
bench = sys.modules["expert_store_bench"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(bench)

MiB = 1 << 20


@pytest.mark.parametrize(
    ("layers", "other"),
    [
        ([MoELayer(0, 8, 1000), MoELayer(1, 8, 1000)], 5000),  # a small cap: the reserve is a tenth of it
        ([MoELayer(i, 128, 2_875_392) for i in range(48)], 3 << 30),  # the 512 MiB reserve
        ([MoELayer(0, 16, 300), MoELayer(3, 16, 700)], 10_000),  # layers of different expert sizes
    ],
)
def test_the_derived_cap_is_the_least_that_gives_every_layer_its_slots(layers: list[MoELayer], other: int) -> None:
    for slots in (1, 2, 5):
        cap = bench.cap_for_slots(layers, other, slots)
        assert [p.slots for p in plan_expert_placement(layers, other, cap).layers] == [slots] * len(layers)
        fewer = plan_expert_placement(layers, other, cap - 1).layers
        assert min(p.slots for p in fewer) == slots - 1


def test_layers_that_fit_the_host_count_the_host_copies() -> None:
    bank = 128 * 2_875_392
    assert bench.layers_that_fit(48, bank, None, 2) == 48
    assert bench.layers_that_fit(48, bank, 200 << 30, 2) == 48
    available = 10 << 30
    for copies in (1, 2):
        fit = bench.layers_that_fit(48, bank, available, copies)
        assert 0 < fit < 48
        assert fit * copies * bank <= available * bench.HOST_HEADROOM < (fit + 1) * copies * bank
    assert bench.host_copies("bf16") == 1 and bench.host_copies("int8") == 2


def test_first_divergence_names_the_stream_and_token() -> None:
    want = [[1, 2, 3], [4, 5, 6]]
    assert bench.first_divergence([[1, 2, 3], [4, 5, 6]], want) == "yes"
    assert bench.first_divergence([[1, 2, 3], [4, 9, 6]], want) == "no: stream 1 at token 1 (1 of 2 streams differ)"
    assert bench.first_divergence([[1, 2, 7], [4, 9, 6]], want).startswith("no: stream 1 at token 1 (2 of 2")


def test_the_random_source_is_seeded_by_name_with_transformers_init() -> None:
    config = bench.model_config("tiny", 1)
    source = bench.random_source(config, "cpu", torch.bfloat16)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert name in source and "model.layers.1.mlp.gate.weight" not in source
    assert torch.equal(source.read(name), bench.random_source(config, "cpu", torch.bfloat16).read(name))
    assert not torch.equal(source.read(name)[0], source.read(name)[1])
    assert torch.equal(source.read("model.norm.weight"), torch.ones(128, dtype=torch.bfloat16))
    assert 0.015 < source.read(name).float().std().item() < 0.025


def whole_model_rows(tmp_path: Path, device: str) -> tuple[list[dict[str, str]], str]:
    out = tmp_path / "es.csv"
    bench.main(
        ["--model", "tiny", "--device", device, "--layers", "2", "--batches", "1,3", "--tokens", "3",
         "--warmup", "2", "--sweep", "0,0.5,1", "--cpu-threads", "1", "--measure-seconds", "0.05", "--out", str(out)]
    )  # fmt: skip
    with out.open() as f:
        rows = list(csv.DictReader(f))
    return rows, out.with_suffix(".svg").read_text()


def check_whole_model(rows: list[dict[str, str]], svg: str, graphed: bool) -> None:
    configs = {(int(r["batch"]), r["config"]) for r in rows}
    stored = ["fetch every miss", "cpu every miss, static hot set", "hybrid at q*", "sweep q=0", "sweep q=0.5"]
    resident = ["resident, eager", *(["resident, graphed"] if graphed else [])]
    assert configs == {(b, c) for b in (1, 3) for c in resident + stored}  # q=1 is the fetch row, not swept twice
    by = {(int(r["batch"]), r["config"]): r for r in rows}
    for b in (1, 3):
        eager = float(by[b, "resident, eager"]["step_ms"])
        for c in stored:
            row = by[b, c]
            assert 0.0 <= float(row["hit_rate"]) <= 1.0
            assert float(row["bound_ms"]) >= eager  # resident eager + the miss service bound
            assert row["tokens_identical"] == "yes" or row["tokens_identical"].startswith("no: stream")
        assert float(by[b, "sweep q=0"]["hit_rate"]) == 0.0  # q = 0 never fills a slot
        assert float(by[b, "sweep q=0"]["fetch_mb_per_step"]) == 0.0
        assert float(by[b, "cpu every miss, static hot set"]["fetch_mb_per_step"]) == 0.0
        assert float(by[b, "cpu every miss, static hot set"]["hit_rate"]) > 0.0  # the hot set serves hits
        assert float(by[b, "fetch every miss"]["fetch_mb_per_step"]) > 0.0
    # batch 1, top 2, 2 slots: every miss fits a slot, nothing runs on the CPU, the tokens are the uncapped run's
    assert float(by[1, "fetch every miss"]["cpu_mb_per_step"]) == 0.0
    assert by[1, "fetch every miss"]["tokens_identical"] == "yes"
    plot = ET.fromstring(svg)
    lines = plot.findall("{http://www.w3.org/2000/svg}polyline")
    assert len(lines) == 2  # one per batch: q = 0, 0.5, q* and 1
    assert all(len(line.get("points", "").split()) == 4 for line in lines)
    assert "q*=" in svg


def test_the_whole_model_mode_runs_every_configuration_on_the_cpu_stand_in(tmp_path: Path) -> None:
    rows, svg = whole_model_rows(tmp_path, "cpu")
    check_whole_model(rows, svg, graphed=False)


@pytest.mark.gpu
def test_the_whole_model_mode_on_cuda_times_graphed_and_eager_and_fetches_bit_for_bit(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    rows, svg = whole_model_rows(tmp_path, "cuda")
    check_whole_model(rows, svg, graphed=True)
