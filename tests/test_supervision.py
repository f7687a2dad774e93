"""`modelfleet up` supervises its children (issue 34): a stage that exits is restarted with backoff
and its streams are replayed into it; past ``--max-stage-restarts`` the fleet fails, says why,
exits non-zero and its streams end with a clear error."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_quickstart import ROOT, descendants, free_port, start_up

from modelfleet.agent.client import FleetClient
from modelfleet.agent.supervisor import GiveUp, Restart, RestartPolicy, Supervisor, exit_description, on_exit
from modelfleet.engine.generate import LocalModel, generate_batch
from modelfleet.engine.sampling import SamplingParams


@pytest.mark.parametrize(
    ("returncode", "restarts", "decision"),
    [
        (1, 0, Restart(1.0, "stage 1 exited with code 1; restarting it in 1 s (restart 1 of 3)")),
        (-9, 2, Restart(4.0, "stage 1 exited with signal SIGKILL; restarting it in 4 s (restart 3 of 3)")),
        (-9, 3, GiveUp("stage 1 exited with signal SIGKILL after 3 restart(s) (--max-stage-restarts=3)")),
    ],
)
def test_a_child_that_exits_is_restarted_with_doubling_backoff_until_its_budget_is_spent(
    returncode, restarts, decision
) -> None:
    assert on_exit(RestartPolicy(max_stage_restarts=3), "stage 1", returncode, restarts) == decision


def test_the_backoff_is_capped_and_a_budget_of_zero_fails_at_the_first_exit() -> None:
    assert on_exit(RestartPolicy(10, 1.0, 30.0), "gateway", 0, 8) == Restart(
        30.0, "gateway exited with code 0; restarting it in 30 s (restart 9 of 10)"
    )
    assert isinstance(on_exit(RestartPolicy(0), "stage 0", 1, 0), GiveUp)
    assert exit_description(-15) == "signal SIGTERM" and exit_description(2) == "code 2"


def test_the_supervisor_restarts_a_child_in_its_place_after_the_backoff_and_counts_it(tmp_path) -> None:
    from modelfleet.agent.launcher import LocalFleet

    fleet = LocalFleet.__new__(LocalFleet)
    LocalFleet.__init__(fleet, None, tmp_path / "plan.json", out=(tmp_path / "log").open("w"))  # type: ignore[arg-type]
    quick = [sys.executable, "-c", "import os, sys; print(os.environ.get('MF_RESTARTS', '0')); sys.exit(3)"]
    fleet.spawn("stage 1", quick, {})
    said: list[str] = []
    supervisor = Supervisor(fleet, RestartPolicy(max_stage_restarts=1, backoff_seconds=0.5), said.append)
    fleet.children[0].process.wait(10)
    supervisor.poll(100.0)
    assert said == ["stage 1 exited with code 3; restarting it in 0.5 s (restart 1 of 1)"] and supervisor.due
    supervisor.poll(100.2)
    assert len(fleet.children) == 1 and supervisor.restarts == {}  # not yet: the backoff
    supervisor.poll(100.6)
    assert supervisor.restarts == {"stage 1": 1} and fleet.children[0].env["MF_RESTARTS"] == "1"
    fleet.children[0].process.wait(10)
    supervisor.poll(101.0)
    assert supervisor.failed == "stage 1 exited with code 3 after 1 restart(s) (--max-stage-restarts=1)"


class Lines:
    """``up``'s output, read by a thread so that it never blocks on a full pipe."""

    def __init__(self, process: subprocess.Popen[str], first: list[str]):
        self.lines = list(first)
        assert process.stdout is not None
        self.thread = threading.Thread(target=lambda: self.lines.extend(process.stdout), daemon=True)  # type: ignore[arg-type]
        self.thread.start()

    def wait_for(self, text: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if found := [line for line in self.lines if text in line]:
                return found[0]
            time.sleep(0.05)
        raise AssertionError(f"no line with {text!r} within {timeout} s:\n" + "".join(self.lines[-30:]))


def stage_pid(up: int, stage: int) -> int:
    for pid in descendants(up):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        if b"agent" in argv and argv[argv.index(b"--stage") + 1] == str(stage).encode():
            return pid
    raise AssertionError(f"stage {stage} is not running")


def wait_tokens(client: FleetClient, request: int, count: int) -> None:
    deadline = time.monotonic() + 30
    while len(client.results[request].token_ids) < count:
        assert time.monotonic() < deadline, "the stream did not start"
        client.poll(0.05)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc to find child processes")
def test_up_restarts_a_killed_stage_whose_streams_go_on_and_fails_the_fleet_once_the_budget_is_spent() -> None:
    demo = ROOT / "models" / "demo"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    command = [str(ROOT / ".venv" / "bin" / "modelfleet"), "up", "--stages", "3", "--insecure-wire",
               "--max-stage-restarts", "1", "--max-streams", "4", "--context-length", "512"]  # fmt: skip
    up, first = start_up(command, free_port(), env)
    lines = Lines(up, first)
    try:
        head = re.search(r"head at (\S+) ", "".join(first))
        assert head, first
        params = SamplingParams(max_tokens=120, stop_token_ids=())
        lm = LocalModel.load(demo, max_slots=1, max_context=512)
        expected = generate_batch(lm, [[5, 6, 7, 8]], [params])[0].token_ids
        with FleetClient(head.group(1), timeout_seconds=120) as client:
            request = client.submit([5, 6, 7, 8], params)
            wait_tokens(client, request, 3)
            subprocess.run(["kill", "-KILL", str(stage_pid(up.pid, 1))], check=True)
            lines.wait_for("stage 1 exited with signal SIGKILL; restarting it in 1 s (restart 1 of 1)", 30)
            result = client.wait([request])[0]
            assert result.finish_reason == "length" and result.token_ids == expected, result.error
            doomed = client.submit([5, 6, 7, 8], SamplingParams(max_tokens=400, stop_token_ids=()))
            wait_tokens(client, doomed, 3)
            subprocess.run(["kill", "-KILL", str(stage_pid(up.pid, 1))], check=True)
            failed = client.wait([doomed])[0]
        assert up.wait(60) == 1
        lines.thread.join(10)
        lines.wait_for("the fleet failed: stage 1 exited with signal SIGKILL after 1 restart(s) "
                       "(--max-stage-restarts=1)", 1)  # fmt: skip
        assert failed.finish_reason == "error" and failed.code == "unavailable", failed.error
        assert "the fleet stopped" in failed.error
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            up.wait(60)
