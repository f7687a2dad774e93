"""llama.cpp as a peer: run a user-built ``llama-bench`` on a GGUF file and read its decode rate.

llama-bench's text-generation test decodes one sequence (batch 1) after an empty prompt, so its
figure stands beside our batch-1 row only. Its JSON output is a list of tests, each with
``n_prompt``, ``n_gen``, ``n_threads`` and ``avg_ts``/``stddev_ts`` (tokens/s). Nothing here builds
llama.cpp (``docs/export.md`` says how to get a GGUF of our model; a llama.cpp build is the user's).

    from llama_peer import llama_bench_decode
    rate = llama_bench_decode(Path("llama-bench"), Path("model.gguf"), threads=2, tokens=64)
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

TIMEOUT_SECONDS = 600  # a bound on one llama-bench run, so a hung peer cannot stall the benchmark


@dataclass(frozen=True)
class PeerRate:
    tokens_per_second: float
    stddev: float
    threads: int


def llama_bench_command(bench: Path, gguf: Path, threads: int, tokens: int, repetitions: int) -> list[str]:
    """Decode-only (no prompt) llama-bench run printing JSON."""
    return [
        str(bench), "-m", str(gguf), "-p", "0", "-n", str(tokens), "-t", str(threads),
        "-r", str(repetitions), "-o", "json",
    ]  # fmt: skip


def parse_llama_bench(stdout: str) -> PeerRate:
    """The text-generation test of llama-bench's JSON output; ValueError naming what is missing."""
    try:
        tests = json.loads(stdout)
    except json.JSONDecodeError as exc:
        raise ValueError(f"llama-bench did not print JSON (-o json): {exc}") from exc
    generation = [t for t in tests if isinstance(t, dict) and t.get("n_gen", 0) > 0 and t.get("n_prompt", 1) == 0]
    if not generation:
        raise ValueError("llama-bench printed no text-generation test (n_gen > 0, n_prompt 0)")
    test = generation[0]
    return PeerRate(float(test["avg_ts"]), float(test.get("stddev_ts", 0.0)), int(test.get("n_threads", 0)))


def llama_bench_decode(bench: Path, gguf: Path, threads: int, tokens: int = 64, repetitions: int = 3) -> PeerRate:
    """Run llama-bench and return its decode rate; RuntimeError with its stderr when it fails."""
    if not bench.is_file():
        raise FileNotFoundError(f"--peer-llama-bench {bench} does not exist (build llama.cpp's llama-bench first)")
    if not gguf.is_file():
        raise FileNotFoundError(f"--peer-gguf {gguf} does not exist (docs/export.md: modelfleet export, then GGUF)")
    command = llama_bench_command(bench, gguf, threads, tokens, repetitions)
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_SECONDS, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    return parse_llama_bench(done.stdout)
