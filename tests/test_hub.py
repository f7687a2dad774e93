"""hf:// checkpoints: `modelfleet fetch` and `modelfleet inspect hf://...` against a fake Hub on 127.0.0.1."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
from fake_hub import FakeHub, Repo, Serving
from tiny import save_model
from typer.testing import CliRunner

from modelfleet.cli import app

COMMIT = "0123456789abcdef0123456789abcdef01234567"
NEEDED_SMALL = {"config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny sharded checkpoint, plus files a load does not need (a README, a nested folder)."""
    path = tmp_path_factory.mktemp("hub") / "tiny"
    save_model("qwen3_moe", path, max_shard_size="40KB")
    (path / "tokenizer.json").write_text("{}")
    (path / "chat_template.jinja").write_text("{{ messages }}")
    (path / "README.md").write_text("# tiny")
    (path / "original").mkdir()
    (path / "original" / "consolidated.safetensors").write_bytes(b"\0" * 64)
    return path


@pytest.fixture
def hub(checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """A running fake Hub with org/tiny, a gated copy and a repository without weights."""
    import huggingface_hub.constants as constants

    no_weights = {"config.json": (checkpoint / "config.json").read_bytes(), "model.bin": b"\0" * 16}
    fake = FakeHub({
        "org/tiny": Repo.from_dir(checkpoint, commit=COMMIT),
        "org/gated": Repo.from_dir(checkpoint, token="hf_granted"),
        "org/pickled": Repo(no_weights),
    })  # fmt: skip
    with Serving(fake) as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        monkeypatch.delenv("HF_TOKEN", raising=False)
        # huggingface_hub reads these at import; the endpoint and token modelfleet passes at call time
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-home" / "hub"))
        yield fake


def needed_files(checkpoint: Path) -> set[str]:
    weights = {p.name for p in checkpoint.glob("*.safetensors")} | {"model.safetensors.index.json"}
    return NEEDED_SMALL | weights


def listed(out: Path) -> set[str]:
    return {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() and ".cache" not in p.parts}


def fetch(*args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(app, ["fetch", *args])


def test_fetch_downloads_exactly_the_files_a_load_needs_once_each(hub, checkpoint, tmp_path):
    result = fetch("hf://org/tiny", "--out", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    assert len(needed_files(checkpoint)) > 6  # several shards
    assert listed(tmp_path / "out") == needed_files(checkpoint) | {".modelfleet-snapshot.json"}
    for name in needed_files(checkpoint):
        assert (tmp_path / "out" / name).read_bytes() == (checkpoint / name).read_bytes()
        assert len(hub.file_requests(name)) == 1, name
    assert not hub.file_requests("README.md") and not hub.file_requests("consolidated.safetensors")
    marker = json.loads((tmp_path / "out" / ".modelfleet-snapshot.json").read_text())
    assert (marker["commit"], marker["uri"]) == (COMMIT, "hf://org/tiny")


def test_a_second_fetch_of_a_complete_snapshot_downloads_nothing(hub, tmp_path):
    out = str(tmp_path / "out")
    assert fetch("hf://org/tiny", "--out", out).exit_code == 0
    before = len(hub.requests)
    again = fetch("hf://org/tiny", "--out", out)
    assert again.exit_code == 0 and "nothing to download" in again.output
    assert [r.path for r in hub.requests[before:]] == ["/api/models/org/tiny"]  # the branch resolved, no file
    before = len(hub.requests)
    assert fetch(f"hf://org/tiny@{COMMIT}", "--out", out).exit_code == 0
    assert hub.requests[before:] == []  # a commit needs no resolving: not one request


def test_an_interrupted_fetch_is_completed_by_downloading_only_what_is_missing(hub, checkpoint, tmp_path):
    out = tmp_path / "out"
    assert fetch("hf://org/tiny", "--out", str(out)).exit_code == 0
    lost = sorted(checkpoint.glob("*.safetensors"))[1].name
    (out / lost).unlink()
    before = len(hub.file_requests())
    assert fetch("hf://org/tiny", "--out", str(out)).exit_code == 0
    again = hub.file_requests()[before:]
    assert len(again) == 1 and again[0].path.startswith("/cdn/")  # the lost shard's bytes, nothing else
    assert (out / lost).read_bytes() == (checkpoint / lost).read_bytes()


def test_fetch_without_weights_takes_config_and_tokenizer_and_include_adds_paths(hub, tmp_path):
    out = tmp_path / "out"
    result = fetch("hf://org/tiny", "--out", str(out), "--no-weights", "--include", "README.*")
    assert result.exit_code == 0, result.output
    assert listed(out) == NEEDED_SMALL | {"README.md", ".modelfleet-snapshot.json"}
    assert not hub.file_requests(".safetensors")


Failure = namedtuple("Failure", "uri hint")


@pytest.mark.parametrize(
    "failure",
    [
        Failure("hf://org/nowhere", "repository not found"),
        Failure("hf://org/tiny@no-such-branch", "revision does not exist"),
        Failure("hf://org/gated", "model.tokenSecret"),
        Failure("hf://org/pickled", "no *.safetensors"),
    ],
    ids=["missing repo", "missing revision", "gated without token", "no safetensors"],
)
def test_fetch_and_inspect_failures_name_the_uri_and_what_to_do(hub, tmp_path, failure):
    for args in (["fetch", failure.uri, "--out", str(tmp_path / "out")], ["inspect", failure.uri]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, result.output
        message = " ".join(result.output.split())
        assert failure.uri in message and failure.hint in message, message
    assert not hub.file_requests(".safetensors")


def test_a_gated_repository_is_fetched_with_hf_token(hub, checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_granted")
    result = fetch("hf://org/gated", "--out", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    assert listed(tmp_path / "out") == needed_files(checkpoint) | {".modelfleet-snapshot.json"}
    hub_requests = [r for r in hub.requests if not r.path.startswith("/cdn/")]
    assert {r.authorization for r in hub_requests} == {"Bearer hf_granted"}
    assert {r.authorization for r in hub.requests if r.path.startswith("/cdn/")} == {None}  # never sent off the Hub


def test_a_volume_too_small_is_reported_before_any_download(hub, tmp_path, monkeypatch):
    import modelfleet.engine.hub as engine_hub

    monkeypatch.setattr(engine_hub.shutil, "disk_usage", lambda path: namedtuple("Usage", "total used free")(1, 1, 0))
    result = fetch("hf://org/tiny", "--out", str(tmp_path / "out"))
    assert result.exit_code == 2
    message = " ".join(result.output.split())
    assert "hf://org/tiny" in message and "free space or give a larger volume" in message, message
    assert hub.file_requests() == []


def test_inspect_over_hf_equals_inspect_of_the_directory_and_reads_only_the_headers(hub, checkpoint):
    remote = CliRunner().invoke(app, ["inspect", "hf://org/tiny"])
    assert remote.exit_code == 0, remote.output
    local = CliRunner().invoke(app, ["inspect", "--model", str(checkpoint)])
    assert local.exit_code == 0, local.output
    assert json.loads(remote.stdout) == json.loads(local.stdout)
    for shard in checkpoint.glob("*.safetensors"):
        (header_length,) = struct.unpack("<Q", shard.read_bytes()[:8])
        ranges = [r.range for r in hub.file_requests(shard.name)]
        assert ranges == ["bytes=0-7", f"bytes=8-{8 + header_length - 1}"], shard.name
    whole = [r for r in hub.file_requests() if r.range is None]
    assert {hub_path.path.rpartition("/")[2] for hub_path in whole} == {"config.json", "model.safetensors.index.json"}


def test_fetch_runs_as_its_own_process_with_token_and_endpoint_from_the_environment(hub, checkpoint, tmp_path):
    """As an init container runs it: huggingface_hub imported fresh, HF_* only in the environment."""
    env = {**os.environ, "HF_TOKEN": "hf_granted", "HF_HUB_OFFLINE": "0", "PYTHONSAFEPATH": "1"}
    command = [sys.executable, "-m", "modelfleet.cli", "fetch", "hf://org/gated", "--out", str(tmp_path / "out")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert listed(tmp_path / "out") == needed_files(checkpoint) | {".modelfleet-snapshot.json"}
    assert {r.authorization for r in hub.requests if r.path.startswith("/org/")} == {"Bearer hf_granted"}


def test_fetch_reports_bytes_as_they_arrive_adding_up_to_the_snapshot(hub, checkpoint, tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    from modelfleet.engine.hub import fetch as fetch_snapshot

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 4096)  # several chunks per tiny shard
    totals: list[int] = []
    seen: list[tuple[str, int]] = []
    out = tmp_path / "out"
    result = fetch_snapshot("hf://org/tiny", out, progress=lambda n, c: seen.append((n, c)), on_start=totals.append)
    sizes = {name: (checkpoint / name).stat().st_size for name in needed_files(checkpoint)}
    assert totals == [sum(sizes.values())] and sum(count for _, count in seen) == totals[0]
    shard = max(sizes, key=sizes.__getitem__)
    assert len([c for n, c in seen if n == shard]) >= sizes[shard] // 4096  # streamed, not reported at the end
    assert set(result.downloaded) == set(sizes)
    (out / shard).unlink()
    again = fetch_snapshot("hf://org/tiny", out)
    assert again.downloaded == (shard,)
