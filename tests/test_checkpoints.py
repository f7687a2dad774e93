"""Loading from checkpoint directories: only the files a shard needs, and clear errors for
every kind of bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tiny import save_model
from typer.testing import CliRunner

from modelfleet.cli import app
from modelfleet.engine.checkpoint import Checkpoint
from modelfleet.engine.errors import CheckpointError, ConfigError, InputError
from modelfleet.engine.frame import Frame
from modelfleet.engine.generate import LocalModel, generate
from modelfleet.engine.models import FAMILIES, MODEL_TYPES
from modelfleet.engine.sampling import SamplingParams
from modelfleet.engine.shard import Shard


@pytest.fixture(scope="module")
def multi_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("multi")
    save_model("qwen3_moe", path, max_shard_size="100KB")
    assert len(list(path.glob("*.safetensors"))) >= 4
    return path


def copy_of(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_a_shard_of_a_multi_file_checkpoint_opens_only_the_files_that_hold_its_tensors(multi_file: Path) -> None:
    index = json.loads((multi_file / "model.safetensors.index.json").read_text())["weight_map"]
    ckpt = Checkpoint(multi_file)
    shard = Shard.load(multi_file, 2, 3, checkpoint=ckpt)
    owned = {f for name, f in index.items() if name.startswith("model.layers.2.")}
    assert {p.name for p in ckpt.files_opened} == owned
    assert len(owned) < len(set(index.values()))
    assert shard.embed is None and shard.head is None and shard.weights_bytes > 0


def test_a_multi_file_checkpoint_gives_the_same_logits_as_reading_it_whole(multi_file: Path, tmp_path: Path) -> None:
    single = tmp_path / "single"
    model = save_model("qwen3_moe", single)
    ids = [3, 9, 27, 81, 115]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    got = LocalModel.load(multi_file, shards=2).forward(Frame.of_streams([(0, 0, ids)]))
    assert torch.allclose(got, ref, atol=1e-4)


def test_loaded_tensors_own_their_storage(multi_file: Path) -> None:
    ckpt = Checkpoint(multi_file)
    name = "model.layers.0.self_attn.q_proj.weight"
    tensor = ckpt.read(name)
    assert tensor.untyped_storage().nbytes() == ckpt.info(name).nbytes


def test_a_missing_directory_is_named_in_the_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        Shard.load(tmp_path / "nowhere")


def test_a_truncated_safetensors_file_is_reported_with_its_sizes(multi_file: Path, tmp_path: Path) -> None:
    broken = copy_of(multi_file, tmp_path / "broken")
    target = sorted(broken.glob("*.safetensors"))[0]
    data = target.read_bytes()
    target.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="truncated file"):
        LocalModel.load(broken)


def test_a_corrupt_safetensors_header_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "corrupt"
    save_model("mixtral", path)
    target = path / "model.safetensors"
    data = bytearray(target.read_bytes())
    data[10:20] = b"\xff" * 10
    target.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        Shard.load(path)


def test_a_config_lacking_moe_fields_names_the_missing_field(tmp_path: Path) -> None:
    path = tmp_path / "nomoe"
    save_model("mixtral", path)
    config = json.loads((path / "config.json").read_text())
    del config["num_experts_per_tok"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        Shard.load(path)


def test_an_unknown_architecture_lists_the_supported_ones(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(ConfigError, match="model_type='llama' is not supported; supported: ") as refused:
        Shard.load(tmp_path)
    assert all(name in str(refused.value) for name in (*FAMILIES, *MODEL_TYPES))


def test_a_prompt_longer_than_the_context_budget_names_both_lengths(multi_file: Path) -> None:
    lm = LocalModel.load(multi_file, max_context=16)
    with pytest.raises(InputError, match="the prompt has 20 tokens; the context length is 16"):
        generate(lm, list(range(20)), SamplingParams())


def test_a_token_id_outside_the_vocabulary_is_refused(multi_file: Path) -> None:
    lm = LocalModel.load(multi_file)
    with pytest.raises(InputError, match=r"token id 128 is outside the vocabulary \[0, 128\)"):
        generate(lm, [1, 128], SamplingParams())
    with pytest.raises(InputError, match="outside the vocabulary"):
        lm.forward(Frame.of_streams([(0, 0, [-1])]))


def test_generate_cli_prints_json_with_tokens_finish_reason_and_timings(multi_file: Path) -> None:
    result = CliRunner().invoke(
        app, ["generate", "--model", str(multi_file), "--prompt-ids", "3,4,5", "--max-tokens", "6", "--json"]
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(out["token_ids"]) <= 6 and out["finish_reason"] in ("stop", "length")
    assert out["weights_bytes"] > 0 and out["total_seconds"] > 0
    lm = LocalModel.load(multi_file)
    assert out["token_ids"] == generate(lm, [3, 4, 5], SamplingParams(max_tokens=6)).token_ids


def test_generate_cli_reports_bad_input_without_a_traceback(tmp_path: Path, multi_file: Path) -> None:
    runner = CliRunner()
    missing = runner.invoke(app, ["generate", "--model", str(tmp_path / "x"), "--prompt-ids", "1"])
    assert missing.exit_code == 2 and "does not exist" in missing.output
    no_tok = runner.invoke(app, ["generate", "--model", str(multi_file), "--prompt", "hello"])
    assert no_tok.exit_code == 2 and "no tokenizer.json" in no_tok.output
    bad_temp = runner.invoke(app, ["generate", "--model", str(multi_file), "--prompt-ids", "1", "--top-p", "0"])
    assert bad_temp.exit_code == 2 and "top_p" in bad_temp.output


def test_generate_cli_decodes_several_prompts_as_one_batch_with_each_prompts_greedy_tokens(multi_file: Path) -> None:
    runner = CliRunner()
    prompts = [[3, 4, 5], [9, 8], [1, 2, 3, 4, 5, 6]]
    batch = runner.invoke(
        app,
        [
            "generate",
            "--model",
            str(multi_file),
            "--prompt-ids",
            "3,4,5; 9,8 ;1,2,3,4,5,6",
            "--max-tokens",
            "6",
            "--json",
        ],
    )
    assert batch.exit_code == 0, batch.output
    out = json.loads(batch.stdout.strip().splitlines()[-1])
    assert out["prompts"] == 3 and out["prompt_tokens"] == [3, 2, 6] and out["decode_tokens_per_second"] > 0
    for ids, tokens in zip(prompts, out["token_ids"], strict=True):
        alone = runner.invoke(
            app,
            [
                "generate",
                "--model",
                str(multi_file),
                "--prompt-ids",
                ",".join(map(str, ids)),
                "--max-tokens",
                "6",
                "--json",
            ],
        )
        assert tokens == json.loads(alone.stdout.strip().splitlines()[-1])["token_ids"]


def test_generate_cli_reads_one_prompt_per_line_and_refuses_an_empty_prompt_list(tmp_path: Path) -> None:
    demo = Path(__file__).resolve().parents[1] / "models" / "demo"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\n\nimport os\n")
    runner = CliRunner()
    out = runner.invoke(
        app, ["generate", "--model", str(demo), "--prompts-file", str(prompts), "--max-tokens", "4", "--json"]
    )
    assert out.exit_code == 0, out.output
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["prompts"] == 2 and len(got["token_ids"]) == 2 and len(got["text"]) == 2
    prompts.write_text("\n  \n")
    empty = runner.invoke(app, ["generate", "--model", str(demo), "--prompts-file", str(prompts)])
    assert empty.exit_code == 2 and "holds no prompt" in empty.output
    both = runner.invoke(app, ["generate", "--model", str(demo), "--prompt", "x", "--prompt-ids", "1"])
    assert both.exit_code == 2 and "exactly one of" in both.output
