"""``modelfleet export``: any checkpoint we load, quantized ones included, written as a plain
Hugging Face checkpoint that transformers loads and that computes our logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tiny import assert_close_to, reference_logits, save_model
from typer.testing import CliRunner

from modelfleet.cli import app
from modelfleet.engine.checkpoint import Checkpoint
from modelfleet.engine.export import export_checkpoint, verify_export
from modelfleet.engine.formats.plan import FormatPlan
from modelfleet.engine.frame import Frame
from modelfleet.engine.quantized_checkpoint import save_quantized
from modelfleet.engine.shard import Shard

IDS = [5, 17, 3, 99, 42, 8, 64, 21]


def quantized_checkpoint(family: str, tmp_path: Path, **overrides: object) -> tuple[Path, Path]:
    source, quantized = tmp_path / "source", tmp_path / "quantized"
    save_model(family, source, **overrides)
    plan = FormatPlan(experts="int4", attention="int8", head="int8")
    save_quantized(Shard.load(source, formats=plan, pack=False), source, quantized, plan, torch.float32)
    return source, quantized


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_an_exported_quantized_model_loads_in_transformers_and_gives_our_logits(tmp_path: Path, family: str) -> None:
    from transformers import AutoModelForCausalLM

    overrides = {"intermediate_size": 64} if family == "mixtral" else {}  # int4 groups of 32
    source, quantized = quantized_checkpoint(family, tmp_path, **overrides)
    out = tmp_path / "exported"
    result = CliRunner().invoke(app, ["export", "--model", str(quantized), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert set(Checkpoint(out).names()) == set(Checkpoint(source).names())  # the family's own names
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    verify_export(quantized, out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = Shard.load(quantized)(Frame.of_streams([(0, 0, IDS)]))
    assert_close_to(ours, reference_logits(model, IDS))


def test_exporting_a_plain_checkpoint_gives_back_its_tensors_bit_for_bit(tmp_path: Path) -> None:
    source = tmp_path / "source"
    save_model("deepseek_v3", source)
    out = tmp_path / "exported"
    export_checkpoint(source, out)
    ckpt = Checkpoint(source)
    for name in ckpt.names():
        with safe_open(str(out / Checkpoint(out).info(name).file.name), "pt") as f:
            assert torch.equal(f.get_tensor(name), ckpt.read(name).to(torch.float32)), name


def test_export_refuses_to_overwrite_a_checkpoint_or_its_source(tmp_path: Path) -> None:
    source = tmp_path / "source"
    save_model("qwen3_moe", source)
    runner = CliRunner()
    same = runner.invoke(app, ["export", "--model", str(source), "--out", str(source)])
    assert same.exit_code == 2 and "must differ" in same.output
    bad = runner.invoke(app, ["export", "--model", str(source), "--out", str(tmp_path / "o"), "--dtype", "int4"])
    assert bad.exit_code == 2 and "--dtype must be one of float32, bfloat16" in bad.output


def _gguf_convert():  # type: ignore[no-untyped-def]
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "tools" / "gguf_convert.py"
    spec = importlib.util.spec_from_file_location("gguf_convert", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_demo_tokenizer_splits_text_exactly_as_gpt2s_pre_tokenizer_that_llama_cpp_names_gpt_2() -> None:
    import regex
    from tokenizers import Tokenizer
    from tokenizers.pre_tokenizers import ByteLevel

    demo = Path(__file__).resolve().parents[1] / "models" / "demo" / "tokenizer.json"
    assert _gguf_convert().llama_cpp_pre_tokenizer(json.loads(demo.read_text())) == "gpt-2"
    gpt2 = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
    to_bytes = ByteLevel(add_prefix_space=False, use_regex=False)
    text = (
        "\n \n\n \t\t \t\n   \n🚀 (normal) 😶\u200d🌫️ ✅ 3 33 3.3 3..3 我想在apple工作1314151天～ ------======= "
        "нещо на Български ''''''```\"\"\"\"......!!!!!!?? I've been 'told he's there, 'RE you sure?\n"
        "def read_lines(path):\n    with open(path) as f:\n        return [l.rstrip() for l in f]  \n\n"
    )
    ours = [piece for piece, _ in Tokenizer.from_file(str(demo)).pre_tokenizer.pre_tokenize_str(text)]
    assert ours == [piece for part in gpt2.findall(text) for piece, _ in to_bytes.pre_tokenize_str(part)]


def test_gguf_conversion_refuses_a_pre_tokenizer_it_cannot_name() -> None:
    convert = _gguf_convert()
    metaspace = {"model": {"type": "BPE"}, "normalizer": None, "pre_tokenizer": {"type": "Metaspace"}}
    with pytest.raises(ValueError, match="is not GPT-2's ByteLevel split"):
        convert.llama_cpp_pre_tokenizer(metaspace)
    with pytest.raises(ValueError, match="only BPE is mapped"):
        convert.llama_cpp_pre_tokenizer({"model": {"type": "Unigram"}})
