"""`modelfleet up`'s run folder and its stop: it says where its plan file is (``modelfleet complete
--plan`` needs it), removes its temporary folder on exit unless --plan-dir named it, and a Ctrl-C
while the stages load is a stop (exit 0), not a failure."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_quickstart import free_port

from modelfleet.agent.launcher import port_free

ROOT = Path(__file__).resolve().parents[1]


def interrupted_while_loading(extra: list[str]) -> tuple[int, Path, str]:
    """Start ``up``, and as soon as it names its plan file press Ctrl-C (SIGINT to the whole process
    group, as a terminal does); its exit code, the plan file it named and its output."""
    base = next(b for b in range(32000, 60000, 100) if all(port_free("127.0.0.1", b + k) for k in range(30)))
    command = [sys.executable, "-P", "-m", "modelfleet.cli", "up", "--port", str(free_port()), "--base-port", str(base)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    up = subprocess.Popen([*command, *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, start_new_session=True)  # fmt: skip
    assert up.stdout is not None
    lines: list[str] = []
    try:
        for line in up.stdout:
            lines.append(line)
            if line.startswith("plan: "):
                break
        time.sleep(1.0)  # the stages have started loading (the plan is written just before they start)
        os.killpg(up.pid, signal.SIGINT)
        rest, _ = up.communicate(timeout=60)
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
    output = "".join(lines) + rest
    found = re.search(r"^plan: (\S+plan\.json)", output, re.MULTILINE)
    assert found, output
    return up.returncode, Path(found.group(1)), output


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="needs process groups")
def test_ctrl_c_while_loading_is_a_stop_and_the_temporary_plan_folder_goes_with_the_fleet() -> None:
    code, plan, output = interrupted_while_loading([])
    assert code == 0, output
    assert "stopping the fleet" in output and "Traceback" not in output
    assert plan.name == "plan.json" and plan.parent.name.startswith("modelfleet-")
    assert not plan.parent.exists(), "up leaves no /tmp/modelfleet-* folder behind"


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="needs process groups")
def test_a_plan_dir_given_by_the_user_is_kept_with_the_plan_in_it(tmp_path) -> None:
    code, plan, output = interrupted_while_loading(["--plan-dir", str(tmp_path / "run")])
    assert code == 0, output
    assert plan == tmp_path / "run" / "plan.json" and plan.is_file()
    assert not (tmp_path / "run" / "keys").exists(), "this run's key pair is removed with its fleet"
