"""DeepSeek-V3's MTP layer (``num_nextn_predict_layers``, layer ``num_hidden_layers`` of the
checkpoint) on a tiny checkpoint written as DeepSeek writes it: what it computes against the
formula in plain torch over the same weights, and as the ``mtp`` proposer of ``generate`` (greedy
output unchanged, proposals made and verified)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_speculative import check_proposals_against, mtp_beside_plain, speculated_as_plain
from tiny import assert_close_to, save_model

from modelfleet.engine.frame import Frame
from modelfleet.engine.generate import LocalModel
from modelfleet.engine.sampling import SamplingParams

REPETITIVE = [5, 17, 99, 3, 64, 5, 17, 99, 3, 64, 5, 17, 99]
EPS = 1e-6  # the tiny config's rms_norm_eps (transformers' default for DeepSeek-V3)


@pytest.fixture(scope="module")
def v3_with_mtp(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A tiny 4-layer DeepSeek-V3 with one MTP layer as ``model.layers.4.*`` (its block an MoE
    layer of a 5-layer model of another seed), and the transformers model of its 4 layers."""
    directory = tmp_path_factory.mktemp("v3_mtp")
    model = save_model("deepseek_v3", directory, seed=0)
    extended_dir = tmp_path_factory.mktemp("v3_extended")
    extended = save_model("deepseek_v3", extended_dir, seed=3, num_hidden_layers=5)
    tensors = load_file(directory / "model.safetensors")
    tensors.update({n: t for n, t in load_file(extended_dir / "model.safetensors").items()
                    if n.startswith("model.layers.4.")})  # fmt: skip
    g = torch.Generator().manual_seed(4)
    hidden, vocab = 64, 128
    own = {
        "enorm.weight": 1.0 + 0.2 * torch.randn(hidden, generator=g),
        "hnorm.weight": 1.0 + 0.2 * torch.randn(hidden, generator=g),
        "eh_proj.weight": 0.08 * torch.randn(hidden, 2 * hidden, generator=g),
        "shared_head.norm.weight": 1.0 + 0.2 * torch.randn(hidden, generator=g),
        "shared_head.head.weight": 0.08 * torch.randn(vocab, hidden, generator=g),
        "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),  # DeepSeek ships a copy
    }
    tensors.update({f"model.layers.4.{name}": t for name, t in own.items()})
    save_file(tensors, directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return directory, model, extended, own


def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def final_hidden(model, ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """transformers' hidden rows after the final norm [T, hidden]."""
    captured = {}
    hook = model.model.norm.register_forward_hook(lambda m, a, out: captured.update(h=out))
    with torch.no_grad():
        model(torch.tensor([ids]))
    hook.remove()
    return captured["h"][0]


@torch.no_grad()
def reference_mtp(model, extended, own, hidden: torch.Tensor, next_ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """logits = head(norm(block(eh_proj([enorm(embed(x_{t+1})); hnorm(h_t)])))), plain torch
    around transformers' decoder layer (its MLA and MoE) as the block, causal over the rows."""
    e = rms(model.model.embed_tokens(torch.tensor(next_ids)), own["enorm.weight"])
    x = torch.cat([e, rms(hidden, own["hnorm.weight"])], dim=-1) @ own["eh_proj.weight"].T
    positions = torch.arange(len(next_ids))[None]
    embeddings = extended.model.rotary_emb(x[None], positions)
    mask = torch.full((len(next_ids), len(next_ids)), float("-inf")).triu(1)[None, None]
    out = extended.model.layers[4](x[None], attention_mask=mask, position_ids=positions,
                                   position_embeddings=embeddings)  # fmt: skip
    out = out[0] if isinstance(out, tuple) else out
    return rms(out[0], own["shared_head.norm.weight"]) @ own["shared_head.head.weight"].T


def test_the_mtp_layer_computes_the_formula_over_the_checkpoint_s_weights(v3_with_mtp) -> None:
    from modelfleet.engine.models.deepseek_v3_mtp import load_mtp

    directory, model, extended, own = v3_with_mtp
    ids = [5, 17, 99, 3, 64, 21, 8, 120, 45, 77, 12, 33, 90, 6, 101, 58, 27]
    hidden = final_hidden(model, ids[:-1])
    mtp = load_mtp(directory)
    mtp.allocate(max_slots=2, max_context=64)
    ours = mtp(Frame.of_streams([(1, 0, ids[1:])], hidden=hidden))
    reference = reference_mtp(model, extended, own, hidden, ids[1:])
    assert_close_to(ours, reference)
    # row by row from its own state, as in one frame
    mtp.allocate(max_slots=1, max_context=64)
    rows = [mtp(Frame.of_streams([(0, t, ids[t + 1 : t + 2])], hidden=hidden[t : t + 1])) for t in range(16)]
    assert_close_to(torch.cat(rows), ours, 1e-5)
    # the target's shard keeps the same rows the layer reads
    lm = LocalModel.load(directory, max_slots=1, max_context=64)
    lm.keep_hidden("normed")
    lm.forward(Frame.of_streams([(0, 0, ids[:-1])]))
    assert lm.final_hidden is not None
    torch.testing.assert_close(lm.final_hidden, hidden, rtol=1e-4, atol=1e-4)


def test_the_reference_depends_on_every_part_of_the_formula(v3_with_mtp) -> None:
    """Guards the test above: dropping the embedding or the hidden row moves the logits."""
    _, model, extended, own = v3_with_mtp
    ids = [5, 17, 99, 3, 64, 21, 8, 120]
    hidden = final_hidden(model, ids[:-1])
    whole = reference_mtp(model, extended, own, hidden, ids[1:])
    assert (whole - reference_mtp(model, extended, own, torch.zeros_like(hidden), ids[1:])).abs().max() > 1e-2
    assert (whole - reference_mtp(model, extended, own, hidden, [0] * 7)).abs().max() > 1e-2


def test_mtp_proposals_from_a_deepseek_v3_checkpoint_leave_greedy_output_unchanged(v3_with_mtp) -> None:
    from modelfleet.engine.models.deepseek_v3_mtp import load_mtp
    from modelfleet.engine.speculative.mtp import SingleMtp

    directory = v3_with_mtp[0]
    prompts = [REPETITIVE, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]
    setup = mtp_beside_plain(directory, prompts, 2, "normed")
    proposer = setup[-1]
    # each proposal is what a fresh layer drafts over all the stream's rows: the kept state never
    # holds a row of an abandoned proposal
    fresh = SingleMtp(load_mtp(directory), reads="normed")
    fresh.allocate_cache(2, 128)
    checked = check_proposals_against(proposer, fresh)
    stats = speculated_as_plain(*setup, prompts)
    assert stats.drafted > 0 and stats.drafted > stats.accepted and set(stats.widths) <= {0, 1}, stats
    assert len(checked) >= 10 and proposer.hidden == {}  # every stream's state went with it


def test_the_cli_speculates_with_a_deepseek_v3_checkpoint_s_mtp_layer(v3_with_mtp) -> None:
    from typer.testing import CliRunner

    from modelfleet.cli import app

    directory = v3_with_mtp[0]
    base = ["generate", "--model", str(directory), "--prompt-ids", ",".join(map(str, REPETITIVE)),
            "--max-tokens", "12", "--json"]  # fmt: skip
    plain = CliRunner().invoke(app, base)
    spec = CliRunner().invoke(app, [*base, "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}'])
    assert plain.exit_code == 0 and spec.exit_code == 0, (plain.output, spec.output)
    ours, theirs = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (spec, plain))
    assert ours["token_ids"] == theirs["token_ids"]
    assert ours["speculative"]["method"] == "mtp" and ours["speculative"]["drafted"] > 0


def test_a_deepseek_v3_checkpoint_without_its_mtp_tensors_is_refused_naming_them(tmp_path: Path) -> None:
    from modelfleet.engine.errors import CheckpointError
    from modelfleet.engine.models.deepseek_v3_mtp import load_mtp

    save_model("deepseek_v3", tmp_path, seed=0)  # transformers' save_pretrained: no MTP layer
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    with pytest.raises(CheckpointError, match=r"model\.layers\.4\.eh_proj\.weight"):
        load_mtp(tmp_path)


def test_a_two_stage_fleet_speculates_with_a_deepseek_v3_checkpoint_s_mtp_layer_at_the_tail(
    v3_with_mtp, tmp_path: Path
) -> None:
    from test_pipeline import Fleet, reference, run_concurrently, wait_until

    directory = v3_with_mtp[0]
    fleet = Fleet(directory, tmp_path, stages=2,
                  speculative={"method": "mtp", "num_speculative_tokens": 1, "adaptive": False})  # fmt: skip
    fleet.start()
    try:
        prompts = [REPETITIVE, [3, 1, 4, 1, 5, 9, 2, 6], REPETITIVE[2:]]
        params = [SamplingParams(max_tokens=8 + 3 * i, stop_token_ids=()) for i in range(len(prompts))]
        assert run_concurrently(fleet, prompts, params) == reference(directory, prompts, params)
        head = fleet.status(0)["head"]["speculative"]
        assert head["method"] == "mtp" and head["drafted"] > 0, head  # the tail's proposals were verified
        wait_until(lambda: [fleet.status(s)["slots_in_use"] for s in range(2)] == [0, 0], 5, "slots freed")
    finally:
        fleet.stop()
