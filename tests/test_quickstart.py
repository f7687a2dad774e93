"""The README's Quickstart, run as a newcomer would: the first command serves the bundled model
behind the gateway; the official openai client completes a prompt; Ctrl-C leaves no process."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import openai
import pytest

from modelfleet.agent.launcher import port_free

ROOT = Path(__file__).resolve().parents[1]


def quickstart_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Quickstart\s+```bash\n(.*?)```", readme, re.S)
    assert block, "README.md has a ## Quickstart section with a bash block"
    return [line.split("#")[0].strip() for line in block.group(1).strip().splitlines()]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def descendants(pid: int) -> set[int]:
    found, frontier = set(), [pid]
    while frontier:
        current = frontier.pop()
        for task in Path(f"/proc/{current}/task").glob("*"):
            children = (task / "children").read_text().split() if (task / "children").exists() else []
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    frontier.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def start_up(command: list[str], port: int, env: dict[str, str]) -> tuple[subprocess.Popen[str], list[str]]:
    """Run a ``modelfleet up`` command with the gateway on ``port`` and free stage ports, until it
    prints the request to try (the fleet is ready); its output lines so far come back with it."""
    base = next(b for b in range(31000, 60000, 100) if all(port_free("127.0.0.1", b + k) for k in range(30)))
    command = [*command, "--port", str(port), "--base-port", str(base)]
    up = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    assert up.stdout is not None
    deadline = time.monotonic() + 300
    for line in up.stdout:
        lines.append(line)
        if line.startswith("try: curl") or time.monotonic() > deadline:
            break
    if not (lines and lines[-1].startswith("try: curl")):
        up.send_signal(signal.SIGINT)
        up.wait(60)
        raise AssertionError("".join(lines[-30:]))
    return up, lines


def test_the_quickstart_has_exactly_two_commands_run_and_test() -> None:
    assert quickstart_commands() == ["bash scripts/up.sh", "bash scripts/test.sh"]


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc to find child processes")
def test_the_first_quickstart_command_serves_the_bundled_model_to_the_openai_client_and_stops_cleanly() -> None:
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    up, lines = start_up(quickstart_commands()[0].split(), port, env)
    try:
        assert any(f"http://127.0.0.1:{port}" in line for line in lines)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        completion = client.completions.create(model="demo", prompt="def add(a, b):\n    ", max_tokens=16)
        assert completion.choices[0].text and completion.usage.completion_tokens >= 1
        chat = subprocess.run(
            [str(ROOT / ".venv" / "bin" / "modelfleet"), "chat", "--url", f"http://127.0.0.1:{port}", "--max-tokens", "8"],
            input="write a function\n", capture_output=True, text=True, timeout=60, env=env,
        )  # fmt: skip
        assert chat.returncode == 0 and chat.stdout.strip(), chat.stderr
        children = descendants(up.pid)
        assert len(children) >= 3, "two stages and the gateway run as child processes"
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(60)
    assert up.returncode == 0, "".join(lines[-20:])
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if alive(pid)], "no process outlives the fleet"


def test_the_readme_test_command_installs_the_pinned_helm_and_ci_runs_only_that_command() -> None:
    # a newcomer's `bash scripts/test.sh` runs the chart tests too: helm is installed by it, not by CI alone
    test_sh = (ROOT / "scripts" / "test.sh").read_text()
    assert "bash tools/helm/install.sh" in test_sh
    assert test_sh.index("tools/helm/install.sh") < test_sh.index("pytest")
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci[-1] == "bash scripts/test.sh" and not any("helm" in line for line in ci)


def test_setup_installs_the_cpu_torch_from_pytorchs_index_with_a_short_timeout_and_falls_back_to_pypi() -> None:
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "https://download.pytorch.org/whl/cpu" in setup and "--timeout 5 --retries 0" in setup
    cpu_try, fallback = setup.index('--index-url "$CPU_INDEX"'), setup.index("did not answer: installing")
    assert cpu_try < fallback
    assert '"${PIP[@]}" "$TORCH"' in setup and '"${PIP[@]}" -e ".[structured]"' in setup, "pip shows its progress"
