"""benchmarks/llama_peer.py: llama-bench's decode rate read from its JSON output (a stand-in
llama-bench here: nothing in CI builds llama.cpp)."""

from __future__ import annotations

import importlib.util
import json
import stat
import sys
from pathlib import Path

import pytest

PEER = Path(__file__).resolve().parents[1] / "benchmarks" / "llama_peer.py"
spec = importlib.util.spec_from_file_location("llama_peer", PEER)
assert spec is not None and spec.loader is not None
llama_peer = sys.modules["llama_peer"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(llama_peer)

REPORT = [
    {"n_prompt": 512, "n_gen": 0, "n_threads": 2, "avg_ts": 1137.0, "stddev_ts": 4.0},
    {"n_prompt": 0, "n_gen": 64, "n_threads": 2, "avg_ts": 121.5, "stddev_ts": 1.25},
]


def test_the_text_generation_test_of_llama_benchs_json_is_the_peer_rate() -> None:
    rate = llama_peer.parse_llama_bench(json.dumps(REPORT))
    assert (rate.tokens_per_second, rate.stddev, rate.threads) == (121.5, 1.25, 2)
    with pytest.raises(ValueError, match="no text-generation test"):
        llama_peer.parse_llama_bench(json.dumps(REPORT[:1]))
    with pytest.raises(ValueError, match="did not print JSON"):
        llama_peer.parse_llama_bench("| model | size |")


def test_a_llama_bench_binary_runs_decode_only_with_the_asked_threads(tmp_path: Path) -> None:
    bench, gguf, args = tmp_path / "llama-bench", tmp_path / "m.gguf", tmp_path / "args"
    gguf.write_bytes(b"GGUF")
    bench.write_text(f"#!/bin/sh\necho \"$@\" > {args}\ncat <<'EOF'\n{json.dumps(REPORT)}\nEOF\n")
    bench.chmod(bench.stat().st_mode | stat.S_IEXEC)
    assert llama_peer.llama_bench_decode(bench, gguf, threads=2, tokens=64).tokens_per_second == 121.5
    assert args.read_text().split() == ["-m", str(gguf), "-p", "0", "-n", "64", "-t", "2", "-r", "3", "-o", "json"]
    with pytest.raises(FileNotFoundError, match="--peer-gguf"):
        llama_peer.llama_bench_decode(bench, tmp_path / "missing.gguf", threads=2)
