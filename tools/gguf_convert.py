"""Convert a plain Hugging Face checkpoint (``modelfleet export`` output) to GGUF with llama.cpp's
own converter, naming the tokenizer's pre-tokenizer when the converter does not recognise it.

llama.cpp's ``convert_hf_to_gguf.py`` identifies a BPE pre-tokenizer by hashing the tokens of a
probe text, so a tokenizer it has not seen (the demo model's, trained here) is refused even when
its pre-tokenizer is one llama.cpp implements. This tool reads tokenizer.json, and where the
pre-tokenizer is exactly GPT-2's (``ByteLevel`` with its regex, no prefix space, no normalizer:
the split ``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+``),
tells the converter "gpt-2", llama.cpp's name for that same split; any other pre-tokenizer is
refused with what it is. Then the converter runs as usual.

    python tools/gguf_convert.py --llama-cpp LLAMA_CPP_DIR --model EXPORTED_DIR --out model.gguf [--outtype bf16]

LLAMA_CPP_DIR holds ``convert_hf_to_gguf.py`` and ``gguf-py`` (a llama.cpp checkout, or
``vendor/llama.cpp`` of the llama-cpp-python sdist). Run it with a Python that has torch,
transformers and numpy (the project's .venv has them); not under PYTHONSAFEPATH, since the
converter imports modules beside itself.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
from pathlib import Path
from typing import Any

GPT2_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}


def llama_cpp_pre_tokenizer(tokenizer: dict[str, Any]) -> str:
    """llama.cpp's name for tokenizer.json's pre-tokenizer, or ValueError saying why there is none."""
    pre = tokenizer.get("pre_tokenizer") or {}
    if tokenizer.get("model", {}).get("type") != "BPE":
        raise ValueError(f"model.type is {tokenizer.get('model', {}).get('type')!r}; only BPE is mapped")
    if tokenizer.get("normalizer") is not None:
        raise ValueError(f"normalizer {tokenizer['normalizer']!r} has no llama.cpp pre-tokenizer equivalent here")
    if any(pre.get(key) != value for key, value in GPT2_BYTE_LEVEL.items()):
        raise ValueError(f"pre_tokenizer {pre!r} is not GPT-2's ByteLevel split {GPT2_BYTE_LEVEL}")
    return "gpt-2"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp", type=Path, required=True, help="directory holding convert_hf_to_gguf.py")
    parser.add_argument("--model", type=Path, required=True, help="plain HF checkpoint (modelfleet export)")
    parser.add_argument("--out", type=Path, required=True, help="GGUF file to write")
    parser.add_argument("--outtype", default="f32", help="the converter's --outtype (f32, bf16, f16, q8_0)")
    args = parser.parse_args()
    script = args.llama_cpp / "convert_hf_to_gguf.py"
    if not script.is_file():
        sys.exit(f"error: {script} does not exist: --llama-cpp must hold llama.cpp's convert_hf_to_gguf.py")
    try:
        name = llama_cpp_pre_tokenizer(json.loads((args.model / "tokenizer.json").read_text()))
    except (OSError, ValueError) as exc:
        sys.exit(f"error: {args.model}/tokenizer.json: {exc}")
    sys.path[:0] = [str(args.llama_cpp), str(args.llama_cpp / "gguf-py")]
    from conversion.base import TextModel  # llama.cpp's converter package, beside the script

    TextModel.get_vocab_base_pre = lambda self, tokenizer: name  # the hook the converter's hash table feeds
    sys.argv = [str(script), str(args.model), "--outfile", str(args.out), "--outtype", args.outtype]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
