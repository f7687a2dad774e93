"""Evaluation tools that nobody here wrote, run unmodified against a live two-stage fleet of the
bundled demo model: lm-eval's ``local-completions`` with a tiny multiple-choice task (scored from
echoed prompt log-probabilities) and a generate task, both at batch size 4 (lists of prompts),
offline; every score and response equals the one computed by the engine directly. guidellm runs
a short bounded load test with its default server checks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_gateway import Served, served_fleet

from modelfleet.engine.generate import LocalModel, generate
from modelfleet.engine.sampling import SamplingParams
from modelfleet.engine.tokenizer import TextTokenizer

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"
TASKS = Path(__file__).resolve().parent / "data" / "lmeval"


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Iterator[Served]:  # type: ignore[no-untyped-def]
    with served_fleet(DEMO, tmp_path_factory.mktemp("demo-fleet")) as served:
        yield served


def test_lm_eval_scores_multiple_choice_and_generate_tasks_in_batches_as_the_engine_does(demo, monkeypatch) -> None:
    pytest.importorskip("lm_eval")
    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(TASKS)  # the tasks name their data files relative to their folder
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = (f"model={demo.gateway.model_name},base_url={demo.url}/v1/completions,tokenizer={DEMO},"
            "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1")  # fmt: skip
    client = get_model("local-completions").create_from_arg_string(args, {"batch_size": 4})
    out = simple_evaluate(model=client, tasks=["mf_choice", "mf_generate"], task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
                          log_samples=True, batch_size=4)  # fmt: skip
    assert out is not None
    engine = LocalModel.load(DEMO, max_slots=1, max_context=512)

    def loglikelihood(context: str, continuation: str) -> float:
        context_ids, continuation_ids = client._encode_pair(context, continuation)
        ids = [*context_ids, *continuation_ids]
        scored = generate(engine, ids, SamplingParams(max_tokens=1, prompt_logprobs=0)).prompt_logprobs
        return sum(scored[q].logprob for q in range(len(context_ids), len(ids)))

    correct = []
    for sample in out["samples"]["mf_choice"]:
        expected = [loglikelihood(*request) for request in sample["arguments"].values()] if isinstance(
            sample["arguments"], dict) else [loglikelihood(*a) for a in sample["arguments"]]  # fmt: skip
        got = [resp[0][0] for resp in sample["resps"]]
        assert got == pytest.approx(expected, abs=2e-3), sample["doc"]
        correct.append(max(range(len(expected)), key=expected.__getitem__) == sample["target"])
    assert out["results"]["mf_choice"]["acc,none"] == pytest.approx(sum(correct) / len(correct))

    text = TextTokenizer(DEMO)
    matches = []
    for sample in out["samples"]["mf_generate"]:
        context = (
            sample["arguments"][0][0]
            if isinstance(sample["arguments"], list)
            else sample["arguments"]["gen_args_0"]["arg_0"]
        )
        ids = client.tok_encode(context)
        tokens = generate(engine, ids, SamplingParams(max_tokens=6)).token_ids
        expected = text.decode(tokens).split("\n")[0]
        assert sample["resps"][0][0] == expected, sample["doc"]
        matches.append(expected == sample["target"])
    assert out["results"]["mf_generate"]["exact_match,none"] == pytest.approx(sum(matches) / len(matches))


def test_guidellm_runs_a_bounded_benchmark_against_the_gateway_with_its_default_checks(demo, tmp_path) -> None:
    """guidellm probes GET /health and /v1/models before it sends anything; four synthetic requests, one at a time."""
    guidellm = shutil.which("guidellm", path=str(Path(sys.executable).parent))
    if guidellm is None:
        pytest.skip("guidellm is not installed")
    report = tmp_path / "report.json"
    command = [
        guidellm, "run", "--backend", f"kind=openai_http,target={demo.url},model={demo.gateway.model_name}",
        "--profile", "kind=synchronous", "--constraint", "kind=max_requests,count=4",
        "--data", "kind=synthetic_text,prompt_tokens=16,output_tokens=8",
        "--tokenizer", f"kind=huggingface_auto,model={DEMO}", "--output", f"kind=json,path={report}",
        "--disable-console-interactive",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    before = _answered(demo)
    run = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert report.is_file(), run.stdout[-3000:]
    assert '"successful"' in report.read_text()
    assert _answered(demo) - before >= 4  # every request guidellm sent was answered


def _answered(served: Served) -> float:
    """Generating requests the gateway answered with 200."""
    registry = served.gateway.metrics.registry
    return sum(registry.get_sample_value("modelfleet_gateway_requests_total", {"endpoint": e, "status": "200"}) or 0.0
               for e in ("/v1/completions", "/v1/chat/completions"))  # fmt: skip
