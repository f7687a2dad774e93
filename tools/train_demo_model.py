"""Train the bundled demo models: a small Qwen3-MoE that writes Python, and a tiny draft model.

Corpus: the Python standard library of the interpreter running this script. Files are split by
a hash of their relative path: every 20th file is held out (never trained on) and listed in the
model directory, so a test can measure next-token accuracy on code the model has not seen.

    python tools/train_demo_model.py prepare --out out/demo-data      # corpus, tokenizer, token ids
    python tools/train_demo_model.py train --data out/demo-data --out out/demo --seconds 75

``prepare`` runs anywhere in about a minute; ``train`` wants a GPU (it runs on a CPU too, slowly):
both wall times are in models/demo/README.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sysconfig
import time
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MAIN = dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
            moe_intermediate_size=256, num_experts=12, num_experts_per_tok=2, intermediate_size=768,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
DRAFT = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2, intermediate_size=384,
             norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
VOCAB = 4096
CONTEXT = 512


def held_out(relative: str) -> bool:
    return int(hashlib.sha256(relative.encode()).hexdigest(), 16) % 20 == 0


def stdlib_files() -> list[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        relative = str(path.relative_to(root))
        if "site-packages" in relative:
            continue
        try:
            files.append((relative, path.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue  # one stdlib file is not UTF-8
    return files


def prepare(out: Path) -> None:
    import numpy as np
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    started = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    files = stdlib_files()
    train = [text for rel, text in files if not held_out(rel)]
    val = [(rel, text) for rel, text in files if held_out(rel)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator(train, trainer)
    tokenizer.save(str(out / "tokenizer.json"))
    eos = tokenizer.token_to_id("<|endoftext|>")
    for name, texts in (("train", train), ("val", [t for _, t in val])):
        ids: list[int] = []
        for encoding in tokenizer.encode_batch(texts):
            ids += encoding.ids + [eos]
        np.array(ids, dtype=np.uint16).tofile(out / f"{name}.bin")
    (out / "heldout_files.txt").write_text("\n".join(rel for rel, _ in val) + "\n")
    print(f"prepared {len(train)} training and {len(val)} held-out files in {time.perf_counter() - started:.0f} s")


def batches(data, batch: int, context: int, device: str, generator):  # type: ignore[no-untyped-def]
    import torch

    while True:
        starts = torch.randint(0, len(data) - context - 1, (batch,), generator=generator)
        rows = torch.stack([data[s : s + context + 1] for s in starts.tolist()]).to(device, torch.long)
        yield rows[:, :-1], rows[:, 1:]


def evaluate(model, data, device: str, context: int, max_tokens: int = 400_000) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """Mean loss and greedy next-token accuracy over the first max_tokens of data."""
    import torch

    model.eval()
    losses, correct, total = [], 0, 0
    with torch.no_grad(), torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16):
        for start in range(0, min(len(data), max_tokens) - context - 1, context):
            rows = data[start : start + context + 1].to(device, torch.long)[None]
            logits = model(rows[:, :-1]).logits.float()
            losses.append(torch.nn.functional.cross_entropy(logits[0], rows[0, 1:]).item())
            correct += int((logits[0].argmax(-1) == rows[0, 1:]).sum())
            total += context
    model.train()
    return sum(losses) / len(losses), correct / total


def train_one(
    shape: dict, data_dir: Path, out: Path, seconds: float, device: str, lr: float, batch: int, eval_tokens: int
) -> dict:
    import numpy as np
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    train = torch.from_numpy(np.fromfile(data_dir / "train.bin", dtype=np.uint16).astype(np.int32))
    val = torch.from_numpy(np.fromfile(data_dir / "val.bin", dtype=np.uint16).astype(np.int32))
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(data_dir / "tokenizer.json"))
    eos = tokenizer.token_to_id("<|endoftext|>")
    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=VOCAB, max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=eos, eos_token_id=eos, router_aux_loss_coef=0.01, output_router_logits=True, **shape,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).to(device)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    stream = batches(train, batch, CONTEXT, device, torch.Generator().manual_seed(1))
    started, step = time.perf_counter(), 0
    warmup = 100
    while (elapsed := time.perf_counter() - started) < seconds:
        progress = min(1.0, elapsed / seconds)
        scale = min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in optimizer.param_groups:
            group["lr"] = lr * scale
        x, y = next(stream)
        with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16):
            outputs = model(x)
            loss = torch.nn.functional.cross_entropy(outputs.logits.float().flatten(0, 1), y.flatten())
            total = loss + config.router_aux_loss_coef * outputs.aux_loss
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        if step % 200 == 0 or step == 1:
            print(f"{out.name}: step {step}, {elapsed:.0f} s, loss {loss.item():.3f}", flush=True)
    wall = time.perf_counter() - started
    val_loss, val_acc = evaluate(model, val, device, CONTEXT, eval_tokens)
    model.config.output_router_logits = False
    model.to(torch.bfloat16).save_pretrained(out, max_shard_size="12MB")
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        # tokenizer_class: transformers' AutoTokenizer would otherwise pick Qwen2's tokenizer from
        # config.json's model_type, whose pre-tokenizer splits differently from tokenizer.json's
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE,
        "model_max_length": 4096,
    }, indent=2))  # fmt: skip
    return {"params": params, "steps": step, "train_seconds": round(wall, 1), "tokens_seen": step * batch * CONTEXT,
            "val_loss": round(val_loss, 4), "val_next_token_accuracy": round(val_acc, 4), "device": device}  # fmt: skip


def train(data_dir: Path, out: Path, seconds: float, device: str, eval_tokens: int) -> None:
    import shutil

    report = {}
    report["main"] = train_one(MAIN, data_dir, out, seconds, device, lr=3e-3, batch=64, eval_tokens=eval_tokens)
    shutil.copy(data_dir / "heldout_files.txt", out / "heldout_files.txt")
    report["draft"] = train_one(
        DRAFT, data_dir, out / "draft", seconds / 4, device, lr=4e-3, batch=64, eval_tokens=eval_tokens
    )
    (out / "training.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="corpus split, tokenizer and token ids")
    p.add_argument("--out", type=Path, default=Path("out/demo-data"))
    t = sub.add_parser("train", help="train the main and draft models")
    t.add_argument("--data", type=Path, default=Path("out/demo-data"))
    t.add_argument("--out", type=Path, default=Path("out/demo"))
    t.add_argument("--seconds", type=float, default=150.0, help="training time of the main model (draft: 1/4)")
    t.add_argument("--device", default="cuda")
    t.add_argument("--eval-tokens", type=int, default=400_000, help="held-out tokens scored after training")
    args = parser.parse_args()
    if args.command == "prepare":
        prepare(args.out)
    else:
        train(args.data, args.out, args.seconds, args.device, args.eval_tokens)


if __name__ == "__main__":
    main()
